package tornadomoe.runtime;

/**
 * Where a kernel runs, with the id of the C ABI's {@code tm_device} enum.
 *
 * <p>{@link #CPU} takes host pointers and runs synchronously (the stream is ignored); {@link #CUDA} takes
 * device pointers and launches asynchronously on the given {@code cudaStream_t}.
 */
public enum Device {
    CPU(0),
    CUDA(1);

    private final int id;

    Device(int id) {
        this.id = id;
    }

    /** The {@code tm_device} value passed to the native functions. */
    public int id() {
        return id;
    }

    /** The device for a {@code tm_device} value; IllegalArgumentException for an unknown one. */
    public static Device fromId(int id) {
        for (Device d : values()) {
            if (d.id == id) {
                return d;
            }
        }
        throw new IllegalArgumentException("unknown tm_device id " + id + " (0 = CPU, 1 = CUDA)");
    }
}
