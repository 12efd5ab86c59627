package tornadomoe.runtime;

/**
 * A native call failed: the C ABI returned a negative {@code tm_status}; the message carries
 * {@code tm_last_error()} (plus, when thrown by an execution plan, the graph and task that failed).
 */
public class TornadoKernelException extends RuntimeException {
    private static final long serialVersionUID = 1L;

    /** tm_status values of the C ABI (tornado_moe.h). */
    public static final int INVALID_ARGUMENT = -1;
    public static final int UNSUPPORTED_QTYPE = -2;
    public static final int NO_CUDA = -3;
    public static final int CUDA_ERROR = -4;
    public static final int UNKNOWN_KERNEL = -5;

    private final int status;

    /** Called by the JNI library. */
    public TornadoKernelException(String message, int status) {
        super(message);
        this.status = status;
    }

    public TornadoKernelException(String message, int status, Throwable cause) {
        super(message, cause);
        this.status = status;
    }

    /** The negative tm_status the native function returned. */
    public int getStatus() {
        return status;
    }

    /** The name of a tm_status value, e.g. "TM_ERR_INVALID_ARGUMENT". */
    public static String statusName(int status) {
        switch (status) {
            case 0: return "TM_OK";
            case INVALID_ARGUMENT: return "TM_ERR_INVALID_ARGUMENT";
            case UNSUPPORTED_QTYPE: return "TM_ERR_UNSUPPORTED_QTYPE";
            case NO_CUDA: return "TM_ERR_NO_CUDA";
            case CUDA_ERROR: return "TM_ERR_CUDA";
            case UNKNOWN_KERNEL: return "TM_ERR_UNKNOWN_KERNEL";
            default: return "tm_status " + status;
        }
    }
}
