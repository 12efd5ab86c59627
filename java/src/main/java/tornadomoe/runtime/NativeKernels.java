package tornadomoe.runtime;

import java.nio.ByteBuffer;

/**
 * The JNI natives: a thin shell over the C ABI's generic invocation ({@code tm_invoke}), kernel table and
 * whole-stream CUDA graph functions (csrc/jni/tornado_moe_jni.cpp). No kernel logic lives here or there:
 * arguments are packed into 64-bit words in Java, per the kernel's signature ({@link KernelArguments}).
 *
 * <p>Call {@link NativeLibrary#load()} first (KernelSet and TornadoExecutionPlan do); without the library
 * these methods throw UnsatisfiedLinkError. Every failing call throws {@link TornadoKernelException} with
 * {@code tm_last_error()}. Stream and graph handles are {@code cudaStream_t} / {@code cudaGraphExec_t}
 * values as longs (0 = the legacy default stream).
 */
public final class NativeKernels {
    static {
        // Best effort, so that direct callers work once the library is findable; a failure is recorded and
        // reported by NativeLibrary.load() with a message saying where it looked.
        NativeLibrary.isAvailable();
    }

    private NativeKernels() {
    }

    /** {@code tm_kernel_count()}. */
    public static native int kernelCount();

    /** {@code tm_kernel_name(index)}. */
    public static native String kernelName(int index);

    /** {@code tm_kernel_signature(index)}: one letter per argument between device and stream. */
    public static native String kernelSignature(int index);

    /** {@code tm_invoke}: launches kernel {@code kernelIndex} with {@code args} packed as 64-bit words. */
    public static native void invoke(int kernelIndex, int device, long[] args, long stream);

    /** {@code tm_cuda_graph_begin_capture(stream)}. */
    public static native void beginCapture(long stream);

    /** {@code tm_cuda_graph_end_capture(stream)}: the instantiated graph. */
    public static native long endCapture(long stream);

    /** {@code tm_cuda_graph_launch(graphExec, stream)}. */
    public static native void launchGraph(long graphExec, long stream);

    /** {@code tm_cuda_graph_destroy(graphExec)}. */
    public static native void destroyGraph(long graphExec);

    /** {@code tm_stream_synchronize(device, stream)} (a no-op on the CPU). */
    public static native void synchronize(int device, long stream);

    /** {@code tm_cuda_compiled()}. */
    public static native boolean cudaCompiled();

    /** {@code tm_cuda_device_count()}. */
    public static native int cudaDeviceCount();

    /** {@code tm_version()}. */
    public static native String version();

    /** The address of a direct ByteBuffer (JNI GetDirectBufferAddress); IllegalArgumentException otherwise. */
    public static native long addressOf(ByteBuffer buffer);
}
