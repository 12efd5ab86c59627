package tornadomoe.runtime;

import java.io.File;

/**
 * Loads the JNI library ({@code libtornado_moe_jni.so}, which links {@code libtornado_moe.so} next to it
 * through rpath $ORIGIN) once per class loader.
 *
 * <p>Where from: the absolute path in the system property {@value #PROPERTY} (what the Python side and the
 * Gradle tests set), else {@code System.loadLibrary("tornado_moe_jni")} ({@code java.library.path}).
 */
public final class NativeLibrary {
    /** System property holding the absolute path of libtornado_moe_jni.so. */
    public static final String PROPERTY = "tornadomoe.jni.library";
    /** The name for System.loadLibrary. */
    public static final String LIBRARY_NAME = "tornado_moe_jni";

    private static boolean loaded;
    private static IllegalStateException failure;

    private NativeLibrary() {
    }

    /**
     * Loads the library if not done yet.
     *
     * @throws IllegalStateException naming where it looked and how to build it, when it cannot be loaded
     *     (the same exception again on later calls: a failed System.load is not retried)
     */
    public static synchronized void load() {
        if (loaded) {
            return;
        }
        if (failure != null) {
            throw failure;
        }
        String path = System.getProperty(PROPERTY);
        try {
            if (path != null && !path.isEmpty()) {
                File file = new File(path);
                if (!file.isFile()) {
                    throw new UnsatisfiedLinkError("no such file");
                }
                System.load(file.getAbsolutePath());
            } else {
                System.loadLibrary(LIBRARY_NAME);
            }
            loaded = true;
        } catch (UnsatisfiedLinkError | SecurityException e) {
            failure = new IllegalStateException("cannot load the tornado-moe JNI library from " + location()
                    + ": " + e.getMessage() + " (build it with a JDK: pip install -e . or the cmake build; "
                    + "then set -D" + PROPERTY + "=<path of libtornado_moe_jni.so>)", e);
            throw failure;
        }
    }

    /** True when {@link #load()} succeeds; never throws. */
    public static boolean isAvailable() {
        try {
            load();
            return true;
        } catch (IllegalStateException e) {
            return false;
        }
    }

    /** Where the library is looked for, for messages. */
    public static String location() {
        String path = System.getProperty(PROPERTY);
        if (path != null && !path.isEmpty()) {
            return "'" + path + "' (system property " + PROPERTY + ")";
        }
        return "lib" + LIBRARY_NAME + ".so on java.library.path (" + System.getProperty("java.library.path")
                + "; system property " + PROPERTY + " unset)";
    }
}
