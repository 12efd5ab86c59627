package tornadomoe.runtime;

import static org.junit.Assert.assertArrayEquals;
import static org.junit.Assert.assertEquals;
import static org.junit.Assert.assertFalse;
import static org.junit.Assert.assertSame;
import static org.junit.Assert.assertThrows;
import static org.junit.Assert.assertTrue;

import java.util.Arrays;

import org.junit.Test;

/** Argument checking and packing per signature letter, on a table built here (no native code). */
public class KernelArgumentsTest {
    private final Kernel all = NativeTestSupport.letterTable().kernel("all_letters"); // "qpnibfu"
    private final DeviceBuffer p = NativeTestSupport.fake(0x1000, Device.CPU, "p");
    private final DeviceBuffer n = NativeTestSupport.fake(0x2000, Device.CPU, "n");

    private static long f32(float f) {
        return Float.floatToRawIntBits(f) & 0xFFFFFFFFL;
    }

    @Test
    public void packsEveryLetterAsTheCAbiDocuments() {
        KernelArguments a = KernelArguments.pack(all, new Object[] {8, p, n, -3L, true, 1.5f, -1L}, "t");
        assertArrayEquals(new long[] {8, 0x1000, 0x2000, -3L, 1, f32(1.5f), -1L}, a.words());
        assertEquals(Arrays.asList(p, n), a.buffers());
        assertSame(all, a.kernel());
    }

    @Test
    public void floatsAreFloat32BitsInTheLowWordAndDoublesRoundLikeACast() {
        KernelArguments a = KernelArguments.pack(all, new Object[] {8L, p, null, 0, false, 0.1, 7}, "t");
        long w = a.words()[5];
        assertEquals(0L, w >>> 32);
        assertEquals(Float.floatToRawIntBits((float) 0.1), (int) w);
        assertEquals(f32(-0.0f), KernelArguments.pack(all, new Object[] {8, p, null, 0, 0, -0.0f, 7}, "t").words()[5]);
        // nullable pointer null -> 0, flag false -> 0, Integer uint64 -> its value
        assertArrayEquals(new long[] {8, 0x1000, 0, 0, 0}, Arrays.copyOf(a.words(), 5));
        assertEquals(7L, a.words()[6]);
        assertEquals(Arrays.asList(p), a.buffers());
    }

    @Test
    public void flagsAcceptIntegerAndLongZeroOrOne() {
        assertEquals(1L, KernelArguments.pack(all, new Object[] {8, p, null, 0, 1, 1f, 0L}, "t").words()[4]);
        assertEquals(1L, KernelArguments.pack(all, new Object[] {8, p, null, 0, 1L, 1f, 0L}, "t").words()[4]);
        IllegalArgumentException e = assertThrows(IllegalArgumentException.class,
                () -> KernelArguments.pack(all, new Object[] {8, p, null, 0, 2, 1f, 0L}, "t"));
        assertTrue(e.getMessage(), e.getMessage().contains("argument 4") && e.getMessage().contains("got 2"));
    }

    @Test
    public void wrongArgumentCountNamesContextKernelAndCounts() {
        IllegalArgumentException e = assertThrows(IllegalArgumentException.class,
                () -> KernelArguments.pack(all, new Object[] {8, p}, "task 'x'"));
        String m = e.getMessage();
        assertTrue(m, m.startsWith("task 'x' (kernel 'all_letters', signature 'qpnibfu')"));
        assertTrue(m, m.contains("expected 7 arguments") && m.contains("got 2"));
    }

    /** One wrong value per letter: the message names the argument index and the expected type. */
    @Test
    public void wrongTypePerLetterNamesIndexAndExpectedType() {
        Object[] good = {8, p, null, 0, true, 1f, 0L};
        Object[][] wrong = {
            {"q", 0, 1.0}, {"p", 1, 5L}, {"p", 1, null}, {"n", 2, "buffer"}, {"i", 3, 2.5f}, {"b", 4, "yes"},
            {"f", 5, 3}, {"u", 6, -1}, {"u", 6, 1.0}, {"q", 0, 1L << 40},
        };
        for (Object[] w : wrong) {
            Object[] args = good.clone();
            int index = (Integer) w[1];
            args[index] = w[2];
            IllegalArgumentException e = assertThrows(IllegalArgumentException.class,
                    () -> KernelArguments.pack(all, args, "task 'x'"));
            String m = e.getMessage();
            assertTrue(m, m.contains("task 'x'") && m.contains("kernel 'all_letters'"));
            assertTrue(m, m.contains("argument " + index + " expects"));
            assertTrue(m, m.contains("'" + w[0] + "'"));
        }
    }

    @Test
    public void releasedBufferIsRefusedAtPackingAndAtCheckLive() {
        DeviceBuffer gone = NativeTestSupport.fake(0x3000, Device.CPU, "layer0.x");
        gone.release();
        IllegalArgumentException e = assertThrows(IllegalArgumentException.class,
                () -> KernelArguments.pack(all, new Object[] {8, gone, null, 0, true, 1f, 0L}, "t"));
        assertTrue(e.getMessage(), e.getMessage().contains("released buffer") && e.getMessage().contains("layer0.x"));

        DeviceBuffer later = NativeTestSupport.fake(0x4000, Device.CPU, "layer0.h");
        KernelArguments a = KernelArguments.pack(all, new Object[] {8, p, later, 0, true, 1f, 0L}, "task 'y'");
        a.checkLive("task 'y'");
        later.release();
        IllegalStateException s = assertThrows(IllegalStateException.class, () -> a.checkLive("task 'y'"));
        assertTrue(s.getMessage(), s.getMessage().contains("task 'y'") && s.getMessage().contains("argument 2")
                && s.getMessage().contains("layer0.h"));
    }

    @Test
    public void kernelRejectsUnknownSignatureLetters() {
        IllegalArgumentException e = assertThrows(IllegalArgumentException.class, () -> new Kernel("k", 0, "ppz"));
        assertTrue(e.getMessage(), e.getMessage().contains("'z'"));
        Kernel k = new Kernel("k", 3, "ppif");
        assertEquals(4, k.arity());
        assertEquals('f', k.argumentType(3));
    }

    @Test
    public void kernelSetLookupAndErrors() {
        KernelSet set = NativeTestSupport.letterTable();
        assertEquals(3, set.size());
        assertEquals(1, set.kernel("copy").index());
        assertTrue(set.contains("scale"));
        assertFalse(set.contains("foo"));
        IllegalArgumentException e = assertThrows(IllegalArgumentException.class, () -> set.kernel("foo"));
        assertEquals("unknown kernel 'foo' (known: all_letters, copy, scale)", e.getMessage());
        assertThrows(IllegalArgumentException.class,
                () -> new KernelSet(Arrays.asList(new Kernel("a", 0, "p"), new Kernel("a", 1, "i"))));
    }

    @Test
    public void deviceBufferWrapChecksAndRelease() {
        assertThrows(IllegalArgumentException.class, () -> DeviceBuffer.wrap(0, 4, Device.CPU, "x"));
        assertThrows(IllegalArgumentException.class, () -> DeviceBuffer.wrap(16, -1, Device.CPU, "x"));
        assertThrows(NullPointerException.class, () -> DeviceBuffer.wrap(16, 4, null, "x"));
        DeviceBuffer b = DeviceBuffer.wrap(0xabc0, 64, Device.CUDA, "w");
        assertEquals(0xabc0, b.getAddress());
        assertEquals(64, b.getBytes());
        assertEquals(Device.CUDA, b.getDevice());
        assertEquals("w", b.getOwner());
        assertFalse(b.isReleased());
        b.release();
        b.release();
        assertTrue(b.isReleased());
        assertTrue(b.toString(), b.toString().contains("'w'") && b.toString().contains("released"));
    }

    @Test
    public void deviceIdsMatchTheCAbi() {
        assertEquals(0, Device.CPU.id());
        assertEquals(1, Device.CUDA.id());
        assertSame(Device.CUDA, Device.fromId(1));
        assertThrows(IllegalArgumentException.class, () -> Device.fromId(7));
    }
}
