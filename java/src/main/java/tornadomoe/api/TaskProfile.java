package tornadomoe.api;

/** Launches and measured time of one task, summed over the executions a profiler result covers. */
public final class TaskProfile {
    private final String graphName;
    private final String taskName;
    private final String kernelName;
    private final long launches;
    private final long kernelTimeNanos;

    public TaskProfile(String graphName, String taskName, String kernelName, long launches, long kernelTimeNanos) {
        this.graphName = graphName;
        this.taskName = taskName;
        this.kernelName = kernelName;
        this.launches = launches;
        this.kernelTimeNanos = kernelTimeNanos;
    }

    public String getGraphName() {
        return graphName;
    }

    public String getTaskName() {
        return taskName;
    }

    public String getKernelName() {
        return kernelName;
    }

    /** Launches of this task: eager ones plus one per CUDA-graph replay. */
    public long getLaunches() {
        return launches;
    }

    /**
     * Time of this task's eager launches in nanoseconds: launch + kernel time, serialised (the stream is
     * synchronised before and after each launch). CUDA-graph replays are timed as a whole, not per task.
     */
    public long getKernelTimeNanos() {
        return kernelTimeNanos;
    }

    @Override
    public String toString() {
        return graphName + "." + taskName + "(" + kernelName + "): " + launches + " launches, "
                + kernelTimeNanos + " ns";
    }
}
