package tornadomoe.runtime;

import java.util.ArrayList;
import java.util.Collections;
import java.util.List;

/**
 * A kernel's arguments checked against its signature and packed into the 64-bit words {@code tm_invoke}
 * takes: pointers as addresses (null as 0), integers sign-extended, flags as 0/1, floats as the bits of a
 * float32 in the low word (a Double is rounded to float, as a Java cast does), uint64 as its bits.
 *
 * <p>Packing happens once, when a task is declared; the buffers are kept so that a plan can refuse to run
 * a task whose memory was released since.
 */
public final class KernelArguments {
    private final Kernel kernel;
    private final long[] words;
    private final List<DeviceBuffer> buffers;
    private final int[] bufferPositions;

    private KernelArguments(Kernel kernel, long[] words, List<DeviceBuffer> buffers, int[] bufferPositions) {
        this.kernel = kernel;
        this.words = words;
        this.buffers = buffers;
        this.bufferPositions = bufferPositions;
    }

    /**
     * Checks and packs {@code args} for {@code kernel}.
     *
     * @param context names the caller in error messages, e.g. "task 'norm' of graph 'layer0'"
     * @throws IllegalArgumentException naming the context, the kernel, the argument index and the expected
     *     type, for a wrong argument count, a wrong type, a null or released buffer, or an out-of-range value
     */
    public static KernelArguments pack(Kernel kernel, Object[] args, String context) {
        String where = context + " (kernel '" + kernel.name() + "', signature '" + kernel.signature() + "')";
        if (args.length != kernel.arity()) {
            throw new IllegalArgumentException(where + ": expected " + kernel.arity()
                    + " arguments (one per signature letter, device and stream excluded), got " + args.length);
        }
        long[] words = new long[args.length];
        List<DeviceBuffer> buffers = new ArrayList<>();
        List<Integer> positions = new ArrayList<>();
        for (int i = 0; i < args.length; i++) {
            char letter = kernel.argumentType(i);
            Object a = args[i];
            switch (letter) {
                case 'p':
                case 'n': {
                    if (a == null && letter == 'n') {
                        words[i] = 0;
                        break;
                    }
                    if (!(a instanceof DeviceBuffer)) {
                        throw mismatch(where, i, letter, a);
                    }
                    DeviceBuffer b = (DeviceBuffer) a;
                    if (b.isReleased()) {
                        throw new IllegalArgumentException(where + ": argument " + i + " expects "
                                + Kernel.describe(letter) + ", got released buffer " + b);
                    }
                    words[i] = b.getAddress();
                    buffers.add(b);
                    positions.add(i);
                    break;
                }
                case 'q': {
                    long v = integral(where, i, letter, a);
                    if (v < Integer.MIN_VALUE || v > Integer.MAX_VALUE) {
                        throw new IllegalArgumentException(where + ": argument " + i + " expects "
                                + Kernel.describe(letter) + " in int range, got " + v);
                    }
                    words[i] = v;
                    break;
                }
                case 'i':
                    words[i] = integral(where, i, letter, a);
                    break;
                case 'b':
                    if (a instanceof Boolean) {
                        words[i] = ((Boolean) a) ? 1 : 0;
                    } else if (a instanceof Integer || a instanceof Long) {
                        long v = ((Number) a).longValue();
                        if (v != 0 && v != 1) {
                            throw new IllegalArgumentException(where + ": argument " + i + " expects "
                                    + Kernel.describe(letter) + ", got " + v);
                        }
                        words[i] = v;
                    } else {
                        throw mismatch(where, i, letter, a);
                    }
                    break;
                case 'f':
                    if (!(a instanceof Float || a instanceof Double)) {
                        throw mismatch(where, i, letter, a);
                    }
                    words[i] = Float.floatToRawIntBits(((Number) a).floatValue()) & 0xFFFFFFFFL;
                    break;
                case 'u':
                    if (a instanceof Long) {
                        words[i] = (Long) a;
                    } else if (a instanceof Integer && (Integer) a >= 0) {
                        words[i] = (Integer) a;
                    } else {
                        throw mismatch(where, i, letter, a);
                    }
                    break;
                default:
                    throw new IllegalStateException(where + ": unknown signature letter '" + letter + "'");
            }
        }
        int[] pos = new int[positions.size()];
        for (int i = 0; i < pos.length; i++) {
            pos[i] = positions.get(i);
        }
        return new KernelArguments(kernel, words, Collections.unmodifiableList(buffers), pos);
    }

    private static long integral(String where, int i, char letter, Object a) {
        if (a instanceof Integer || a instanceof Long) {
            return ((Number) a).longValue();
        }
        throw mismatch(where, i, letter, a);
    }

    private static IllegalArgumentException mismatch(String where, int i, char letter, Object a) {
        String got = a == null ? "null" : a.getClass().getName() + " " + a;
        return new IllegalArgumentException(where + ": argument " + i + " expects " + Kernel.describe(letter)
                + ", got " + got);
    }

    /**
     * Refuses to run when a buffer was released after packing.
     *
     * @throws IllegalStateException naming the context, kernel, argument index and buffer
     */
    public void checkLive(String context) {
        for (int j = 0; j < buffers.size(); j++) {
            DeviceBuffer b = buffers.get(j);
            if (b.isReleased()) {
                throw new IllegalStateException(context + " (kernel '" + kernel.name() + "'): argument "
                        + bufferPositions[j] + " uses released buffer " + b);
            }
        }
    }

    public Kernel kernel() {
        return kernel;
    }

    /** The packed words (a copy). */
    public long[] words() {
        return words.clone();
    }

    /** The buffers among the arguments, in argument order (nulls excluded). */
    public List<DeviceBuffer> buffers() {
        return buffers;
    }

    /** Launches the kernel once: tm_invoke on {@code device} and {@code stream}. */
    public void invoke(Device device, long stream) {
        NativeKernels.invoke(kernel.index(), device.id(), words, stream);
    }
}
