package tornadomoe.api;

/**
 * When a declared transfer happens (TornadoVM's DataTransferMode). Buffers here are device addresses owned
 * by the caller, so declarations are recorded (they document a graph's inputs and outputs) and copy nothing.
 */
public final class DataTransferMode {
    /** Copied once, before the first execution (weights, caches). */
    public static final int FIRST_EXECUTION = 0;
    /** Copied at every execution (per-step inputs and outputs). */
    public static final int EVERY_EXECUTION = 1;
    /** Copied only when the caller asks for it. */
    public static final int UNDER_DEMAND = 2;

    private DataTransferMode() {
    }

    /** The constant's name; IllegalArgumentException for an unknown mode. */
    public static String name(int mode) {
        switch (mode) {
            case FIRST_EXECUTION: return "FIRST_EXECUTION";
            case EVERY_EXECUTION: return "EVERY_EXECUTION";
            case UNDER_DEMAND: return "UNDER_DEMAND";
            default:
                throw new IllegalArgumentException("unknown data transfer mode " + mode
                        + " (FIRST_EXECUTION = 0, EVERY_EXECUTION = 1, UNDER_DEMAND = 2)");
        }
    }
}
