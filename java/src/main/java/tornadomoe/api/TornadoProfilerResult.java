package tornadomoe.api;

import java.util.Collections;
import java.util.List;

/**
 * Kernel launches and kernel time per task (TornadoVM's TornadoProfilerResult).
 *
 * <p>How time is measured: an eager launch is timed on the host clock with the stream synchronised before
 * and after it ({@code tm_stream_synchronize}): "launch + kernel time, serialised". That makes profiled
 * runs slower than unprofiled ones, and each number an upper bound of the kernel's own time. A CUDA-graph
 * replay counts one launch for every task in the graph, and its time (synchronised the same way) is
 * reported for the replay as a whole in {@link #getCudaGraphTimeNanos()}: kernels inside a replay cannot be
 * told apart without a device profiler.
 */
public final class TornadoProfilerResult {
    private final List<TaskProfile> tasks;
    private final long cudaGraphReplays;
    private final long cudaGraphTimeNanos;

    TornadoProfilerResult(List<TaskProfile> tasks, long cudaGraphReplays, long cudaGraphTimeNanos) {
        this.tasks = Collections.unmodifiableList(tasks);
        this.cudaGraphReplays = cudaGraphReplays;
        this.cudaGraphTimeNanos = cudaGraphTimeNanos;
    }

    /** One entry per task of the plan, in graph then task order. */
    public List<TaskProfile> getTaskProfiles() {
        return tasks;
    }

    /** The entry of {@code taskName} in graph {@code graphName}; IllegalArgumentException if none. */
    public TaskProfile getTaskProfile(String graphName, String taskName) {
        for (TaskProfile p : tasks) {
            if (p.getGraphName().equals(graphName) && p.getTaskName().equals(taskName)) {
                return p;
            }
        }
        throw new IllegalArgumentException("no task '" + taskName + "' in graph '" + graphName + "'");
    }

    /** Total kernel launches (eager launches plus tasks times CUDA-graph replays). */
    public long getKernelCount() {
        long n = 0;
        for (TaskProfile p : tasks) {
            n += p.getLaunches();
        }
        return n;
    }

    /** Steps run by CUDA-graph replays (the capturing execution's launch included; a graph may hold several). */
    public long getCudaGraphReplays() {
        return cudaGraphReplays;
    }

    /** Summed time of the CUDA-graph replays in nanoseconds. */
    public long getCudaGraphTimeNanos() {
        return cudaGraphTimeNanos;
    }

    /** Eager task time plus CUDA-graph replay time, in nanoseconds. */
    public long getTotalKernelTimeNanos() {
        long t = cudaGraphTimeNanos;
        for (TaskProfile p : tasks) {
            t += p.getKernelTimeNanos();
        }
        return t;
    }

    /** A table: one row per task, then the CUDA-graph replays and the totals. */
    @Override
    public String toString() {
        StringBuilder sb = new StringBuilder();
        sb.append(String.format("%-16s %-34s %-22s %10s %14s%n", "graph", "task", "kernel", "launches",
                "time_us"));
        for (TaskProfile p : tasks) {
            sb.append(String.format("%-16s %-34s %-22s %10d %14.1f%n", p.getGraphName(), p.getTaskName(),
                    p.getKernelName(), p.getLaunches(), p.getKernelTimeNanos() / 1e3));
        }
        if (cudaGraphReplays > 0) {
            sb.append(String.format("%-74s %10d %14.1f%n", "CUDA graph replays (time for whole replays)",
                    cudaGraphReplays, cudaGraphTimeNanos / 1e3));
        }
        sb.append(String.format("total kernel launches: %d, time: %.3f ms", getKernelCount(),
                getTotalKernelTimeNanos() / 1e6));
        return sb.toString();
    }
}
