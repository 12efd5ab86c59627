package tornadomoe.api;

import java.util.ArrayList;
import java.util.Collections;
import java.util.HashMap;
import java.util.HashSet;
import java.util.IdentityHashMap;
import java.util.List;
import java.util.Map;
import java.util.Objects;
import java.util.Set;

import tornadomoe.runtime.Device;
import tornadomoe.runtime.DeviceBuffer;
import tornadomoe.runtime.NativeKernels;
import tornadomoe.runtime.NativeLibrary;
import tornadomoe.runtime.TornadoKernelException;

/**
 * Runs immutable task graphs (TornadoVM's TornadoExecutionPlan): every task of every graph, in order, one
 * {@code tm_invoke} each, on one device and one stream.
 *
 * <ul>
 *   <li>Device: by default the device of the graphs' buffers (buffers on different devices are refused);
 *       {@link #withDevice(Device)} states it, and is refused if a buffer lives elsewhere.</li>
 *   <li>Stream: {@link #withStream(long)} takes a {@code cudaStream_t} as a long (default 0, the legacy
 *       default stream; ignored on the CPU).</li>
 *   <li>{@link #withCUDAGraph()}: the next {@link #execute()} captures every task of every graph into one
 *       CUDA graph (whole-stream capture through the native functions) and launches it; later executions
 *       replay it. {@link #execute(int)} runs the tasks several times over, as one graph of that many
 *       steps (one graph per step count, each captured at its first use). Capture needs a stream other than
 *       the legacy default one. Values that change per step must live in device memory (the kernels read
 *       positions from memory for this reason).</li>
 *   <li>{@link #withProfiler(ProfilerMode)}: launches and time per task, see {@link TornadoProfilerResult}.</li>
 * </ul>
 * Before every execution the plan checks that no buffer was released. A closed plan refuses everything
 * except {@link #close()} and the getters.
 */
public final class TornadoExecutionPlan implements AutoCloseable {
    private final List<ImmutableTaskGraph> graphs;
    private final Task[] tasks;
    private final String[] contexts;
    private final int[][] flatIndex;
    private final List<DeviceBuffer> buffers;
    private Device device;
    private long stream;
    private boolean useCudaGraph;
    private final Map<Integer, Long> graphExecs = new HashMap<>();  // steps per replay -> executable graph
    private ProfilerMode profilerMode;
    private Profile cumulative;
    private boolean closed;

    /**
     * A plan over {@code graphs}, run in the given order.
     *
     * @throws IllegalArgumentException for no graph, a null graph, two graphs of one name, or buffers on
     *     different devices
     */
    public TornadoExecutionPlan(ImmutableTaskGraph... graphs) {
        if (graphs == null || graphs.length == 0) {
            throw new IllegalArgumentException("an execution plan needs at least one task graph");
        }
        List<ImmutableTaskGraph> list = new ArrayList<>();
        Set<String> names = new HashSet<>();
        for (int i = 0; i < graphs.length; i++) {
            ImmutableTaskGraph g = graphs[i];
            if (g == null) {
                throw new IllegalArgumentException("task graph " + i + " of the plan is null");
            }
            if (!names.add(g.getTaskGraphName())) {
                throw new IllegalArgumentException("two task graphs named '" + g.getTaskGraphName()
                        + "' in one plan (profiles and messages name tasks by graph name)");
            }
            list.add(g);
        }
        this.graphs = Collections.unmodifiableList(list);
        List<Task> flat = new ArrayList<>();
        List<String> ctx = new ArrayList<>();
        flatIndex = new int[list.size()][];
        Map<DeviceBuffer, Boolean> seen = new IdentityHashMap<>();
        List<DeviceBuffer> all = new ArrayList<>();
        for (int g = 0; g < list.size(); g++) {
            ImmutableTaskGraph graph = list.get(g);
            flatIndex[g] = new int[graph.getTaskCount()];
            for (int t = 0; t < graph.getTaskCount(); t++) {
                flatIndex[g][t] = flat.size();
                flat.add(graph.getTask(t));
                ctx.add("task graph '" + graph.getTaskGraphName() + "', task '" + graph.getTask(t).getName() + "'");
            }
            for (DeviceBuffer b : graph.getBuffers()) {
                if (seen.put(b, Boolean.TRUE) == null) {
                    all.add(b);
                }
            }
        }
        this.tasks = flat.toArray(new Task[0]);
        this.contexts = ctx.toArray(new String[0]);
        this.buffers = Collections.unmodifiableList(all);
        this.device = inferDevice(all);
    }

    private static Device inferDevice(List<DeviceBuffer> buffers) {
        DeviceBuffer first = null;
        for (DeviceBuffer b : buffers) {
            if (first == null) {
                first = b;
            } else if (b.getDevice() != first.getDevice()) {
                throw new IllegalArgumentException("buffers on different devices in one plan: " + first + " and "
                        + b + " (a plan runs on one device)");
            }
        }
        return first == null ? Device.CPU : first.getDevice();
    }

    /**
     * Runs on {@code target}; every buffer must live there.
     *
     * @throws IllegalArgumentException naming a buffer on another device
     */
    public synchronized TornadoExecutionPlan withDevice(Device target) {
        checkOpen();
        Objects.requireNonNull(target, "device");
        for (DeviceBuffer b : buffers) {
            if (b.getDevice() != target) {
                throw new IllegalArgumentException("cannot run the plan on " + target + ": buffer " + b
                        + " lives on " + b.getDevice());
            }
        }
        if (target != device) {
            dropCudaGraph();
            device = target;
        }
        return this;
    }

    /** Launches on this {@code cudaStream_t} (as a long; 0 = the legacy default stream). */
    public synchronized TornadoExecutionPlan withStream(long streamHandle) {
        checkOpen();
        stream = streamHandle;
        return this;
    }

    /**
     * Captures the tasks into one CUDA graph at the next execution and replays it afterwards.
     *
     * @throws IllegalStateException when the plan does not run on the CUDA device
     */
    public synchronized TornadoExecutionPlan withCUDAGraph() {
        checkOpen();
        if (device != Device.CUDA) {
            throw new IllegalStateException("CUDA graphs need the CUDA device (this plan runs on " + device + ")");
        }
        useCudaGraph = true;
        return this;
    }

    /** Back to eager launches; destroys a captured graph. */
    public synchronized TornadoExecutionPlan withoutCUDAGraph() {
        checkOpen();
        useCudaGraph = false;
        dropCudaGraph();
        return this;
    }

    /** Profiles every launch from now on; starts a fresh cumulative profile. */
    public synchronized TornadoExecutionPlan withProfiler(ProfilerMode mode) {
        checkOpen();
        profilerMode = Objects.requireNonNull(mode, "profiler mode");
        cumulative = new Profile(tasks.length);
        return this;
    }

    /** Stops profiling; the cumulative profile so far stays readable. */
    public synchronized TornadoExecutionPlan withoutProfiler() {
        checkOpen();
        profilerMode = null;
        return this;
    }

    /**
     * Launches every task of every graph in order (or captures / replays the CUDA graph).
     *
     * @throws IllegalStateException when the plan is closed, a buffer was released, or a CUDA graph is
     *     asked for on the legacy default stream
     * @throws TornadoKernelException when a launch fails (the message names graph, task and kernel)
     */
    public synchronized TornadoExecutionResult execute() {
        return execute(1);
    }

    /**
     * Runs every task of every graph {@code steps} times over, in order: with a CUDA graph, one replay of a
     * graph that holds all the steps.
     *
     * @throws IllegalArgumentException when {@code steps} is below 1
     * @throws IllegalStateException as {@link #execute()}
     * @throws TornadoKernelException as {@link #execute()}
     */
    public synchronized TornadoExecutionResult execute(int steps) {
        checkOpen();
        if (steps < 1) {
            throw new IllegalArgumentException("steps must be at least 1, got " + steps);
        }
        for (int i = 0; i < tasks.length; i++) {
            tasks[i].getPackedArguments().checkLive(contexts[i]);
        }
        NativeLibrary.load();
        Profile p = profilerMode != null ? new Profile(tasks.length) : null;
        boolean replay = false;
        if (useCudaGraph) {
            if (device != Device.CUDA) {
                throw new IllegalStateException("CUDA graphs need the CUDA device (this plan runs on " + device + ")");
            }
            if (stream == 0) {
                throw new IllegalStateException("CUDA graph capture needs a created stream: call withStream(handle); "
                        + "the legacy default stream (0) cannot be captured");
            }
            Long graphExec = graphExecs.get(steps);
            if (graphExec == null) {
                graphExec = capture(steps);
                graphExecs.put(steps, graphExec);
            }
            replayGraph(graphExec, steps, p);
            replay = true;
        } else {
            if (p != null) {
                synchronize();
            }
            launchSteps(steps, p);
        }
        return finish(p, replay);
    }

    /**
     * One eager launch of one task (also when a CUDA graph is enabled), e.g. to debug or to time one kernel.
     *
     * @throws IndexOutOfBoundsException for a graph or task index out of range
     */
    public synchronized TornadoExecutionResult executeTask(int graphIndex, int taskIndex) {
        checkOpen();
        if (graphIndex < 0 || graphIndex >= graphs.size()) {
            throw new IndexOutOfBoundsException("the plan has " + graphs.size() + " task graphs, no graph "
                    + graphIndex);
        }
        if (taskIndex < 0 || taskIndex >= flatIndex[graphIndex].length) {
            throw new IndexOutOfBoundsException("task graph '" + graphs.get(graphIndex).getTaskGraphName()
                    + "' has " + flatIndex[graphIndex].length + " tasks, no task " + taskIndex);
        }
        int i = flatIndex[graphIndex][taskIndex];
        tasks[i].getPackedArguments().checkLive(contexts[i]);
        NativeLibrary.load();
        Profile p = profilerMode != null ? new Profile(tasks.length) : null;
        if (p != null) {
            synchronize();
        }
        launch(i, p);
        return finish(p, false);
    }

    private TornadoExecutionResult finish(Profile p, boolean replay) {
        if (p == null) {
            return new TornadoExecutionResult(null, replay);
        }
        cumulative.add(p);
        TornadoProfilerResult r = p.result();
        if (profilerMode == ProfilerMode.CONSOLE) {
            System.out.println(r);
        }
        return new TornadoExecutionResult(r, replay);
    }

    private void launch(int i, Profile p) {
        try {
            if (p == null) {
                tasks[i].getPackedArguments().invoke(device, stream);
            } else {
                long t0 = System.nanoTime();
                tasks[i].getPackedArguments().invoke(device, stream);
                synchronize();
                p.launches[i]++;
                p.nanos[i] += System.nanoTime() - t0;
            }
        } catch (TornadoKernelException e) {
            throw new TornadoKernelException(contexts[i] + " (kernel '" + tasks[i].getKernelName() + "'): "
                    + e.getMessage(), e.getStatus(), e);
        }
    }

    private void synchronize() {
        NativeKernels.synchronize(device.id(), stream);
    }

    /** Every task, in order, {@code steps} times over (eagerly, or into a capture when {@code p} is null). */
    private void launchSteps(int steps, Profile p) {
        for (int s = 0; s < steps; s++) {
            for (int i = 0; i < tasks.length; i++) {
                launch(i, p);
            }
        }
    }

    private long capture(int steps) {
        NativeKernels.beginCapture(stream);
        try {
            launchSteps(steps, null);
        } catch (RuntimeException e) {
            // End the capture so the stream is usable again; the partial graph is discarded.
            try {
                long partial = NativeKernels.endCapture(stream);
                if (partial != 0) {
                    NativeKernels.destroyGraph(partial);
                }
            } catch (RuntimeException suppressed) {
                e.addSuppressed(suppressed);
            }
            throw e;
        }
        return NativeKernels.endCapture(stream);
    }

    private void replayGraph(long graphExec, int steps, Profile p) {
        if (p == null) {
            NativeKernels.launchGraph(graphExec, stream);
            return;
        }
        synchronize();
        long t0 = System.nanoTime();
        NativeKernels.launchGraph(graphExec, stream);
        synchronize();
        p.graphNanos += System.nanoTime() - t0;
        p.graphReplays += steps;
        for (int i = 0; i < tasks.length; i++) {
            p.launches[i] += steps;
        }
    }

    private void dropCudaGraph() {
        List<Long> execs = new ArrayList<>(graphExecs.values());
        graphExecs.clear();
        for (long g : execs) {
            NativeKernels.destroyGraph(g);
        }
    }

    private void checkOpen() {
        if (closed) {
            throw new IllegalStateException("the execution plan is closed");
        }
    }

    /**
     * The profile summed over every launch since {@link #withProfiler(ProfilerMode)}.
     *
     * @throws IllegalStateException when the profiler was never enabled
     */
    public synchronized TornadoProfilerResult getProfilerResult() {
        if (cumulative == null) {
            throw new IllegalStateException("the profiler was never enabled: call withProfiler(...) first");
        }
        return cumulative.result();
    }

    /** Destroys the CUDA graph, if any; the plan refuses to run afterwards. Idempotent. */
    @Override
    public synchronized void close() {
        if (closed) {
            return;
        }
        closed = true;
        dropCudaGraph();
    }

    public synchronized boolean isClosed() {
        return closed;
    }

    public List<ImmutableTaskGraph> getGraphs() {
        return graphs;
    }

    /** Launches one eager execution makes: one per task. */
    public int getTaskCount() {
        return tasks.length;
    }

    public synchronized Device getDevice() {
        return device;
    }

    public synchronized long getStream() {
        return stream;
    }

    public synchronized boolean isCUDAGraphEnabled() {
        return useCudaGraph;
    }

    /** True once a CUDA graph has been captured (and not dropped since). */
    public synchronized boolean hasCUDAGraph() {
        return !graphExecs.isEmpty();
    }

    public synchronized boolean isProfilerEnabled() {
        return profilerMode != null;
    }

    /** Per-task counters; {@link #result()} names them by graph and task. */
    private final class Profile {
        final long[] launches;
        final long[] nanos;
        long graphReplays;
        long graphNanos;

        Profile(int n) {
            launches = new long[n];
            nanos = new long[n];
        }

        void add(Profile o) {
            for (int i = 0; i < launches.length; i++) {
                launches[i] += o.launches[i];
                nanos[i] += o.nanos[i];
            }
            graphReplays += o.graphReplays;
            graphNanos += o.graphNanos;
        }

        TornadoProfilerResult result() {
            List<TaskProfile> rows = new ArrayList<>(tasks.length);
            for (int g = 0; g < graphs.size(); g++) {
                for (int t = 0; t < flatIndex[g].length; t++) {
                    int i = flatIndex[g][t];
                    rows.add(new TaskProfile(graphs.get(g).getTaskGraphName(), tasks[i].getName(),
                            tasks[i].getKernelName(), launches[i], nanos[i]));
                }
            }
            return new TornadoProfilerResult(rows, graphReplays, graphNanos);
        }
    }
}
