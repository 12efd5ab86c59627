package tornadomoe.runtime;

import java.io.File;
import java.nio.ByteBuffer;
import java.nio.ByteOrder;
import java.util.Arrays;

import org.junit.Assume;

/** Helpers for the tests: skipping without the JNI library, host buffers, and a small kernel table. */
public final class NativeTestSupport {
    private NativeTestSupport() {
    }

    /**
     * Skips the calling test when the JNI library was not built (the Gradle test task points the system
     * property at tornado_moe/_native/libtornado_moe_jni.so); a library that exists but fails to load fails.
     */
    public static void assumeNativeLibrary() {
        String path = System.getProperty(NativeLibrary.PROPERTY);
        if (path != null && !path.isEmpty()) {
            Assume.assumeTrue("JNI library not built at " + path + " (build it with pip install -e . or cmake "
                    + "--build; then rerun gradle test --offline): skipping", new File(path).isFile());
            NativeLibrary.load();
        } else {
            Assume.assumeTrue("system property " + NativeLibrary.PROPERTY + " unset and the JNI library is not on "
                    + "java.library.path: skipping", NativeLibrary.isAvailable());
        }
    }

    /**
     * A table for testing the graph logic without native code: one kernel taking every signature letter,
     * plus two small ones. (The native table itself is tested in NativeKernelTableTest.)
     */
    public static KernelSet letterTable() {
        return new KernelSet(Arrays.asList(
                new Kernel("all_letters", 0, "qpnibfu"),
                new Kernel("copy", 1, "ppi"),
                new Kernel("scale", 2, "ppif")));
    }

    /** A direct, native-order buffer holding {@code values}. */
    public static ByteBuffer floats(float... values) {
        ByteBuffer b = ByteBuffer.allocateDirect(Math.max(4, values.length * 4)).order(ByteOrder.nativeOrder());
        for (float v : values) {
            b.putFloat(v);
        }
        b.clear();
        return b;
    }

    /** A direct, native-order buffer of {@code n} zero floats. */
    public static ByteBuffer zeros(int n) {
        return floats(new float[n]);
    }

    /** A direct, native-order buffer holding {@code values} as int32. */
    public static ByteBuffer ints(int... values) {
        ByteBuffer b = ByteBuffer.allocateDirect(Math.max(4, values.length * 4)).order(ByteOrder.nativeOrder());
        for (int v : values) {
            b.putInt(v);
        }
        b.clear();
        return b;
    }

    public static float[] readFloats(ByteBuffer b, int n) {
        float[] out = new float[n];
        for (int i = 0; i < n; i++) {
            out[i] = b.getFloat(i * 4);
        }
        return out;
    }

    public static int[] readInts(ByteBuffer b, int n) {
        int[] out = new int[n];
        for (int i = 0; i < n; i++) {
            out[i] = b.getInt(i * 4);
        }
        return out;
    }

    /** A fake, never dereferenced, address for graph-logic tests. */
    public static DeviceBuffer fake(long address, Device device, String owner) {
        return DeviceBuffer.wrap(address, 1024, device, owner);
    }
}
