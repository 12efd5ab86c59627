package tornadomoe.api;

import static org.junit.Assert.assertEquals;
import static org.junit.Assert.assertFalse;
import static org.junit.Assert.assertThrows;
import static org.junit.Assert.assertTrue;

import org.junit.Test;

import tornadomoe.runtime.Device;
import tornadomoe.runtime.DeviceBuffer;
import tornadomoe.runtime.KernelSet;
import tornadomoe.runtime.NativeTestSupport;

/**
 * Plan construction and life cycle. Every check here happens before any native call, so these tests run
 * without the JNI library (fake addresses are never dereferenced).
 */
public class ExecutionPlanLifecycleTest {
    private final KernelSet table = NativeTestSupport.letterTable();

    private ImmutableTaskGraph graph(String name, DeviceBuffer a, DeviceBuffer b) {
        return new TaskGraph(name, table).task("copy", "copy", a, b, 4L).snapshot();
    }

    private DeviceBuffer cpu(long address) {
        return NativeTestSupport.fake(address, Device.CPU, "cpu@" + address);
    }

    private DeviceBuffer cuda(long address) {
        return NativeTestSupport.fake(address, Device.CUDA, "cuda@" + address);
    }

    @Test
    public void deviceIsInferredFromTheBuffers() {
        assertEquals(Device.CPU, new TornadoExecutionPlan(graph("g", cpu(16), cpu(32))).getDevice());
        assertEquals(Device.CUDA, new TornadoExecutionPlan(graph("g", cuda(16), cuda(32))).getDevice());
        ImmutableTaskGraph empty = new TaskGraph("empty", table).snapshot();
        assertEquals(Device.CPU, new TornadoExecutionPlan(empty).getDevice());
    }

    @Test
    public void mixedDevicesAreRejected() {
        IllegalArgumentException inGraph = assertThrows(IllegalArgumentException.class,
                () -> new TornadoExecutionPlan(graph("g", cpu(16), cuda(32))));
        assertTrue(inGraph.getMessage(), inGraph.getMessage().contains("different devices")
                && inGraph.getMessage().contains("cpu@16") && inGraph.getMessage().contains("cuda@32"));
        assertThrows(IllegalArgumentException.class,
                () -> new TornadoExecutionPlan(graph("a", cpu(16), cpu(32)), graph("b", cuda(48), cuda(64))));
        TornadoExecutionPlan plan = new TornadoExecutionPlan(graph("g", cpu(16), cpu(32)));
        IllegalArgumentException with = assertThrows(IllegalArgumentException.class, () -> plan.withDevice(Device.CUDA));
        assertTrue(with.getMessage(), with.getMessage().contains("cpu@16") && with.getMessage().contains("lives on CPU"));
        assertEquals(Device.CPU, plan.withDevice(Device.CPU).getDevice());
    }

    @Test
    public void planArgumentsAreChecked() {
        assertThrows(IllegalArgumentException.class, () -> new TornadoExecutionPlan());
        assertThrows(IllegalArgumentException.class, () -> new TornadoExecutionPlan((ImmutableTaskGraph) null));
        IllegalArgumentException dup = assertThrows(IllegalArgumentException.class,
                () -> new TornadoExecutionPlan(graph("g", cpu(16), cpu(32)), graph("g", cpu(16), cpu(32))));
        assertTrue(dup.getMessage(), dup.getMessage().contains("two task graphs named 'g'"));
    }

    @Test
    public void cudaGraphNeedsTheCudaDevice() {
        TornadoExecutionPlan plan = new TornadoExecutionPlan(graph("g", cpu(16), cpu(32)));
        IllegalStateException e = assertThrows(IllegalStateException.class, plan::withCUDAGraph);
        assertTrue(e.getMessage(), e.getMessage().contains("CUDA graphs need the CUDA device"));
        assertFalse(plan.isCUDAGraphEnabled());
        TornadoExecutionPlan gpu = new TornadoExecutionPlan(graph("g", cuda(16), cuda(32)));
        assertTrue(gpu.withCUDAGraph().isCUDAGraphEnabled());
        assertFalse(gpu.hasCUDAGraph());
        assertFalse(gpu.withoutCUDAGraph().isCUDAGraphEnabled());
    }

    @Test
    public void closedPlanRefusesEverythingAndCloseIsIdempotent() {
        TornadoExecutionPlan plan = new TornadoExecutionPlan(graph("g", cpu(16), cpu(32)));
        plan.close();
        plan.close();
        assertTrue(plan.isClosed());
        IllegalStateException e = assertThrows(IllegalStateException.class, plan::execute);
        assertEquals("the execution plan is closed", e.getMessage());
        assertThrows(IllegalStateException.class, () -> plan.executeTask(0, 0));
        assertThrows(IllegalStateException.class, () -> plan.withStream(5));
        assertThrows(IllegalStateException.class, () -> plan.withProfiler(ProfilerMode.SILENT));
        assertThrows(IllegalStateException.class, () -> plan.withDevice(Device.CPU));
        try (TornadoExecutionPlan p = new TornadoExecutionPlan(graph("h", cpu(16), cpu(32)))) {
            assertFalse(p.isClosed());
        }
    }

    @Test
    public void releasedBufferIsRefusedAtExecuteNamingTheTask() {
        DeviceBuffer out = cpu(32);
        TornadoExecutionPlan plan = new TornadoExecutionPlan(graph("layer7", cpu(16), out));
        out.release();
        IllegalStateException e = assertThrows(IllegalStateException.class, plan::execute);
        assertTrue(e.getMessage(), e.getMessage().contains("task graph 'layer7', task 'copy'")
                && e.getMessage().contains("argument 1 uses released buffer") && e.getMessage().contains("cpu@32"));
        assertThrows(IllegalStateException.class, () -> plan.executeTask(0, 0));
    }

    @Test
    public void executeTaskIndicesAreChecked() {
        TornadoExecutionPlan plan = new TornadoExecutionPlan(graph("g", cpu(16), cpu(32)));
        IndexOutOfBoundsException g = assertThrows(IndexOutOfBoundsException.class, () -> plan.executeTask(1, 0));
        assertTrue(g.getMessage(), g.getMessage().contains("no graph 1"));
        IndexOutOfBoundsException t = assertThrows(IndexOutOfBoundsException.class, () -> plan.executeTask(0, 1));
        assertTrue(t.getMessage(), t.getMessage().contains("task graph 'g' has 1 tasks, no task 1"));
    }

    @Test
    public void profilerResultNeedsTheProfiler() {
        TornadoExecutionPlan plan = new TornadoExecutionPlan(graph("g", cpu(16), cpu(32)));
        assertThrows(IllegalStateException.class, plan::getProfilerResult);
        assertFalse(plan.isProfilerEnabled());
        plan.withProfiler(ProfilerMode.SILENT);
        assertTrue(plan.isProfilerEnabled());
        TornadoProfilerResult r = plan.getProfilerResult();
        assertEquals(0, r.getKernelCount());
        assertEquals(1, r.getTaskProfiles().size());
        assertEquals("copy", r.getTaskProfile("g", "copy").getKernelName());
        assertFalse(plan.withoutProfiler().isProfilerEnabled());
        assertEquals(0, plan.getProfilerResult().getKernelCount());
    }
}
