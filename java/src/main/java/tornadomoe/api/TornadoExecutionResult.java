package tornadomoe.api;

/** What one {@code execute()} returns (TornadoVM's TornadoExecutionResult). */
public final class TornadoExecutionResult {
    private final TornadoProfilerResult profilerResult;
    private final boolean cudaGraphReplay;

    TornadoExecutionResult(TornadoProfilerResult profilerResult, boolean cudaGraphReplay) {
        this.profilerResult = profilerResult;
        this.cudaGraphReplay = cudaGraphReplay;
    }

    /**
     * The profile of this execution alone (the plan's {@code getProfilerResult()} sums all of them).
     *
     * @throws IllegalStateException when the plan ran without a profiler
     */
    public TornadoProfilerResult getProfilerResult() {
        if (profilerResult == null) {
            throw new IllegalStateException("the plan ran without a profiler: call withProfiler(...) first");
        }
        return profilerResult;
    }

    public boolean isProfilerEnabled() {
        return profilerResult != null;
    }

    /** True when this execution launched the plan's CUDA graph instead of the tasks one by one. */
    public boolean isCUDAGraphReplay() {
        return cudaGraphReplay;
    }
}
