package tornadomoe.api;

import static org.junit.Assert.assertEquals;
import static org.junit.Assert.assertFalse;
import static org.junit.Assert.assertThrows;
import static org.junit.Assert.assertTrue;

import java.io.ByteArrayOutputStream;
import java.io.PrintStream;
import java.nio.ByteBuffer;
import java.nio.charset.StandardCharsets;

import org.junit.Before;
import org.junit.Test;

import tornadomoe.runtime.DeviceBuffer;
import tornadomoe.runtime.NativeTestSupport;

/** The profiler counts every launch and times eager launches, through real CPU kernels. */
public class ProfilerTest {
    private ImmutableTaskGraph first;
    private ImmutableTaskGraph second;
    private ByteBuffer x;

    @Before
    public void build() {
        NativeTestSupport.assumeNativeLibrary();
        int dim = 256;
        float[] values = new float[dim];
        for (int i = 0; i < dim; i++) {
            values[i] = (i % 13) - 6f;
        }
        x = NativeTestSupport.floats(values);
        DeviceBuffer xb = DeviceBuffer.wrapDirect(x, "x");
        DeviceBuffer w = DeviceBuffer.wrapDirect(NativeTestSupport.floats(values), "w");
        DeviceBuffer h = DeviceBuffer.wrapDirect(NativeTestSupport.zeros(dim), "h");
        DeviceBuffer ids = DeviceBuffer.wrapDirect(NativeTestSupport.ints(0), "ids");
        first = new TaskGraph("layer0")
                .task("norm", "rmsnorm", xb, w, h, 1L, (long) dim, 1e-6f)
                .task("argmax", "argmax", h, ids, 1L, (long) dim)
                .snapshot();
        second = new TaskGraph("logits").task("argmax", "argmax", xb, ids, 1L, (long) dim).snapshot();
    }

    @Test
    public void countsLaunchesPerTaskAcrossExecutions() {
        try (TornadoExecutionPlan plan = new TornadoExecutionPlan(first, second)) {
            TornadoExecutionResult unprofiled = plan.execute();
            assertFalse(unprofiled.isProfilerEnabled());
            assertThrows(IllegalStateException.class, unprofiled::getProfilerResult);

            plan.withProfiler(ProfilerMode.SILENT);
            TornadoExecutionResult last = null;
            for (int i = 0; i < 3; i++) {
                last = plan.execute();
            }
            plan.executeTask(0, 1);

            TornadoProfilerResult one = last.getProfilerResult();
            assertEquals(3, one.getKernelCount());
            assertFalse(last.isCUDAGraphReplay());

            TornadoProfilerResult all = plan.getProfilerResult();
            assertEquals(3, all.getTaskProfiles().size());
            assertEquals(3, all.getTaskProfile("layer0", "norm").getLaunches());
            assertEquals(4, all.getTaskProfile("layer0", "argmax").getLaunches());
            assertEquals(3, all.getTaskProfile("logits", "argmax").getLaunches());
            assertEquals("rmsnorm", all.getTaskProfile("layer0", "norm").getKernelName());
            assertEquals(10, all.getKernelCount());
            assertEquals(0, all.getCudaGraphReplays());
            long sum = 0;
            for (TaskProfile p : all.getTaskProfiles()) {
                assertTrue(p.toString(), p.getKernelTimeNanos() > 0);
                sum += p.getKernelTimeNanos();
            }
            assertEquals(sum, all.getTotalKernelTimeNanos());
            String table = all.toString();
            assertTrue(table, table.contains("layer0") && table.contains("norm") && table.contains("rmsnorm")
                    && table.contains("total kernel launches: 10"));

            plan.withProfiler(ProfilerMode.SILENT);
            assertEquals("withProfiler starts afresh", 0, plan.getProfilerResult().getKernelCount());
            plan.withoutProfiler().execute();
            assertEquals("no counting without the profiler", 0, plan.getProfilerResult().getKernelCount());
        }
    }

    @Test
    public void severalStepsRunEveryTaskThatManyTimes() {
        try (TornadoExecutionPlan plan = new TornadoExecutionPlan(first, second)) {
            plan.withProfiler(ProfilerMode.SILENT);
            TornadoExecutionResult r = plan.execute(4);
            assertEquals(12, r.getProfilerResult().getKernelCount());
            assertEquals(4, plan.getProfilerResult().getTaskProfile("layer0", "norm").getLaunches());
            assertEquals(4, plan.getProfilerResult().getTaskProfile("logits", "argmax").getLaunches());
            IllegalArgumentException none = assertThrows(IllegalArgumentException.class, () -> plan.execute(0));
            assertTrue(none.getMessage(), none.getMessage().contains("at least 1"));
        }
    }

    @Test
    public void consoleModePrintsEachExecution() {
        PrintStream saved = System.out;
        ByteArrayOutputStream captured = new ByteArrayOutputStream();
        try (TornadoExecutionPlan plan = new TornadoExecutionPlan(first)) {
            System.setOut(new PrintStream(captured, true, StandardCharsets.UTF_8));
            plan.withProfiler(ProfilerMode.CONSOLE).execute();
        } finally {
            System.setOut(saved);
        }
        String out = captured.toString(StandardCharsets.UTF_8);
        assertTrue(out, out.contains("layer0") && out.contains("total kernel launches: 2"));
    }
}
