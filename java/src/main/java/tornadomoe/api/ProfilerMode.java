package tornadomoe.api;

/** How a plan's profiler reports (TornadoVM's ProfilerMode). */
public enum ProfilerMode {
    /** Collect only; read the result from the execution result or the plan. */
    SILENT,
    /** Collect and print each execution's table to standard output. */
    CONSOLE
}
