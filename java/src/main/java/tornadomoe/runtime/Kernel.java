package tornadomoe.runtime;

import java.util.Objects;

/**
 * One entry of the native kernel table: its name, its index for {@code tm_invoke} and its signature, one
 * letter per argument between {@code device} and {@code stream}:
 * 'q' qtype (int), 'p' pointer (non-null), 'n' nullable pointer, 'i' int64, 'b' int flag, 'f' float32,
 * 'u' uint64.
 */
public final class Kernel {
    /** Every signature letter the C ABI defines. */
    public static final String LETTERS = "qpnibfu";

    private final String name;
    private final int index;
    private final String signature;

    public Kernel(String name, int index, String signature) {
        this.name = Objects.requireNonNull(name, "name");
        this.signature = Objects.requireNonNull(signature, "signature");
        this.index = index;
        for (int i = 0; i < signature.length(); i++) {
            if (LETTERS.indexOf(signature.charAt(i)) < 0) {
                throw new IllegalArgumentException("kernel '" + name + "': unknown signature letter '"
                        + signature.charAt(i) + "' at " + i + " in '" + signature + "' (known: " + LETTERS + ")");
            }
        }
    }

    public String name() {
        return name;
    }

    public int index() {
        return index;
    }

    public String signature() {
        return signature;
    }

    /** Number of arguments a task passes (device and stream excluded). */
    public int arity() {
        return signature.length();
    }

    /** The signature letter of argument {@code i}. */
    public char argumentType(int i) {
        return signature.charAt(i);
    }

    /** What a signature letter accepts, in words, for error messages. */
    public static String describe(char letter) {
        switch (letter) {
            case 'q': return "a qtype ('q': Integer or Long)";
            case 'p': return "a buffer ('p': non-null, unreleased DeviceBuffer)";
            case 'n': return "a nullable buffer ('n': DeviceBuffer or null)";
            case 'i': return "an int64 ('i': Integer or Long)";
            case 'b': return "a flag ('b': Boolean, or Integer/Long 0 or 1)";
            case 'f': return "a float32 ('f': Float or Double)";
            case 'u': return "a uint64 ('u': Long, any 64 bits, or non-negative Integer)";
            default: return "'" + letter + "'";
        }
    }

    @Override
    public boolean equals(Object o) {
        if (!(o instanceof Kernel)) {
            return false;
        }
        Kernel k = (Kernel) o;
        return k.index == index && k.name.equals(name) && k.signature.equals(signature);
    }

    @Override
    public int hashCode() {
        return Objects.hash(name, index, signature);
    }

    @Override
    public String toString() {
        return name + "#" + index + "(" + signature + ")";
    }
}
