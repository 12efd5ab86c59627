package tornadomoe.runtime;

import java.util.ArrayList;
import java.util.Collections;
import java.util.LinkedHashMap;
import java.util.List;
import java.util.Map;

/**
 * A kernel table: names, tm_invoke indices and signatures. {@link #nativeSet()} reads the native library's
 * table once ({@code tm_kernel_count/name/signature}); other tables can be built for tests of the graph
 * logic. {@link #get(String)} looks a kernel up in the native table.
 */
public final class KernelSet {
    private static KernelSet nativeSet;

    private final List<Kernel> kernels;
    private final Map<String, Kernel> byName;

    /** A table of the given kernels (names must be unique). */
    public KernelSet(List<Kernel> kernels) {
        this.kernels = Collections.unmodifiableList(new ArrayList<>(kernels));
        Map<String, Kernel> map = new LinkedHashMap<>();
        for (Kernel k : this.kernels) {
            if (map.put(k.name(), k) != null) {
                throw new IllegalArgumentException("duplicate kernel name '" + k.name() + "' in kernel table");
            }
        }
        this.byName = Collections.unmodifiableMap(map);
    }

    /**
     * The native kernel table, read once from the JNI library (loading it first).
     *
     * @throws IllegalStateException when the library cannot be loaded
     */
    public static synchronized KernelSet nativeSet() {
        if (nativeSet == null) {
            NativeLibrary.load();
            int n = NativeKernels.kernelCount();
            List<Kernel> list = new ArrayList<>(n);
            for (int i = 0; i < n; i++) {
                list.add(new Kernel(NativeKernels.kernelName(i), i, NativeKernels.kernelSignature(i)));
            }
            nativeSet = new KernelSet(list);
        }
        return nativeSet;
    }

    /** The native kernel called {@code name}; IllegalArgumentException naming the known ones otherwise. */
    public static Kernel get(String name) {
        return nativeSet().kernel(name);
    }

    /** The kernel called {@code name} in this table; IllegalArgumentException naming the known ones. */
    public Kernel kernel(String name) {
        Kernel k = byName.get(name);
        if (k == null) {
            throw new IllegalArgumentException("unknown kernel '" + name + "' (known: "
                    + String.join(", ", byName.keySet()) + ")");
        }
        return k;
    }

    public boolean contains(String name) {
        return byName.containsKey(name);
    }

    public List<Kernel> kernels() {
        return kernels;
    }

    public List<String> names() {
        return new ArrayList<>(byName.keySet());
    }

    public int size() {
        return kernels.size();
    }

    @Override
    public String toString() {
        return "KernelSet" + kernels;
    }
}
