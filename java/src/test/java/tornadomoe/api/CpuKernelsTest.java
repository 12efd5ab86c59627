package tornadomoe.api;

import static org.junit.Assert.assertArrayEquals;
import static org.junit.Assert.assertEquals;
import static org.junit.Assert.assertThrows;
import static org.junit.Assert.assertTrue;

import java.nio.ByteBuffer;
import java.nio.ByteOrder;
import java.util.Random;

import org.junit.Before;
import org.junit.Test;

import tornadomoe.runtime.Device;
import tornadomoe.runtime.DeviceBuffer;
import tornadomoe.runtime.NativeKernels;
import tornadomoe.runtime.NativeTestSupport;
import tornadomoe.runtime.TornadoKernelException;

/**
 * CPU kernels launched through task graphs, an execution plan and JNI, on direct ByteBuffers, against
 * references computed here in double precision. Inputs are chosen so that most results are exactly
 * representable (then the comparison is bitwise); rmsnorm is compared within a float32 rounding bound.
 */
public class CpuKernelsTest {
    private static final int F32 = 0;
    private static final int Q8_0 = 8;

    @Before
    public void needsNativeLibrary() {
        NativeTestSupport.assumeNativeLibrary();
    }

    private static DeviceBuffer buf(ByteBuffer b, String owner) {
        return DeviceBuffer.wrapDirect(b, owner);
    }

    private static void run(TaskGraph g) {
        try (TornadoExecutionPlan plan = new TornadoExecutionPlan(g.snapshot())) {
            plan.execute();
        }
    }

    /** Q8_0 rows: per 32 values an fp16 scale (given as its bits) then 32 int8 codes. */
    private static ByteBuffer q8_0(int rows, int cols, short[] scaleBits, byte[] codes) {
        int blocks = cols / 32;
        ByteBuffer b = ByteBuffer.allocateDirect(rows * blocks * 34).order(ByteOrder.LITTLE_ENDIAN);
        for (int r = 0; r < rows; r++) {
            for (int k = 0; k < blocks; k++) {
                b.putShort(scaleBits[r * blocks + k]);
                for (int j = 0; j < 32; j++) {
                    b.put(codes[r * cols + k * 32 + j]);
                }
            }
        }
        b.clear();
        return b;
    }

    private static final short[] FP16_BITS = {0x3400, 0x3800, 0x3C00, 0x4000}; // 0.25, 0.5, 1, 2
    private static final double[] FP16_VALUES = {0.25, 0.5, 1.0, 2.0};

    @Test
    public void embeddingGathersRowsAndRejectsBadIds() {
        int vocab = 5, dim = 8;
        float[] table = new float[vocab * dim];
        for (int i = 0; i < table.length; i++) {
            table[i] = i * 0.5f - 7f;
        }
        ByteBuffer out = NativeTestSupport.zeros(3 * dim);
        ByteBuffer ids = NativeTestSupport.ints(3, 0, 4);
        run(new TaskGraph("g").task("embed", "embedding", F32, buf(NativeTestSupport.floats(table), "table"),
                buf(ids, "ids"), buf(out, "out"), 3L, (long) vocab, (long) dim));
        float[] got = NativeTestSupport.readFloats(out, 3 * dim);
        int[] rows = {3, 0, 4};
        for (int t = 0; t < 3; t++) {
            for (int c = 0; c < dim; c++) {
                assertEquals(Float.floatToRawIntBits(table[rows[t] * dim + c]), Float.floatToRawIntBits(got[t * dim + c]));
            }
        }
        ByteBuffer bad = NativeTestSupport.ints(vocab);
        TornadoKernelException e = assertThrows(TornadoKernelException.class,
                () -> run(new TaskGraph("emb").task("embed", "embedding", F32,
                        buf(NativeTestSupport.floats(table), "table"), buf(bad, "ids"), buf(out, "out"), 1L,
                        (long) vocab, (long) dim)));
        assertEquals(TornadoKernelException.INVALID_ARGUMENT, e.getStatus());
        assertTrue(e.getMessage(), e.getMessage().startsWith("task graph 'emb', task 'embed' (kernel 'embedding'): ")
                && e.getMessage().contains("out of range"));
    }

    @Test
    public void rmsnormMatchesDoubleReference() {
        int tokens = 3, dim = 67;
        Random rng = new Random(42);
        float[] x = new float[tokens * dim];
        float[] w = new float[dim];
        for (int i = 0; i < x.length; i++) {
            x[i] = (float) (rng.nextDouble() * 4 - 2);
        }
        for (int i = 0; i < dim; i++) {
            w[i] = (float) (0.5 + rng.nextDouble());
        }
        float eps = 1e-5f;
        ByteBuffer y = NativeTestSupport.zeros(tokens * dim);
        ByteBuffer xb = NativeTestSupport.floats(x);
        run(new TaskGraph("g").task("norm", "rmsnorm", buf(xb, "x"), buf(NativeTestSupport.floats(w), "w"),
                buf(y, "y"), (long) tokens, (long) dim, eps));
        float[] got = NativeTestSupport.readFloats(y, tokens * dim);
        for (int t = 0; t < tokens; t++) {
            double ss = 0;
            for (int c = 0; c < dim; c++) {
                ss += (double) x[t * dim + c] * x[t * dim + c];
            }
            double inv = 1.0 / Math.sqrt(ss / dim + eps);
            for (int c = 0; c < dim; c++) {
                double ref = x[t * dim + c] * inv * w[c];
                // float32 sum of 67 squares, sqrt, divide, two multiplies: a few ulps of float32
                assertEquals("t=" + t + " c=" + c, ref, got[t * dim + c], 4e-6 * Math.abs(ref) + 1e-7);
            }
        }
        // In place (x and y alias, allowed by the header): bitwise the same as out of place.
        run(new TaskGraph("g").task("norm", "rmsnorm", buf(xb, "x"), buf(NativeTestSupport.floats(w), "w"),
                buf(xb, "x"), (long) tokens, (long) dim, eps));
        float[] inPlace = NativeTestSupport.readFloats(xb, tokens * dim);
        for (int i = 0; i < got.length; i++) {
            assertEquals(Float.floatToRawIntBits(got[i]), Float.floatToRawIntBits(inPlace[i]));
        }
    }

    @Test
    public void rmsnormExactCase() {
        // x = 2 everywhere, eps = 0: mean square 4, 2 / sqrt(4) = 1 exactly, so y == w bit for bit.
        int dim = 40;
        float[] x = new float[dim];
        float[] w = new float[dim];
        for (int i = 0; i < dim; i++) {
            x[i] = 2f;
            w[i] = i - 17.5f;
        }
        ByteBuffer y = NativeTestSupport.zeros(dim);
        run(new TaskGraph("g").task("norm", "rmsnorm", buf(NativeTestSupport.floats(x), "x"),
                buf(NativeTestSupport.floats(w), "w"), buf(y, "y"), 1L, (long) dim, 0.0));
        assertArrayEquals(w, NativeTestSupport.readFloats(y, dim), 0f);
    }

    @Test
    public void matmulF32IsExactOnIntegers() {
        int tokens = 2, rows = 5, cols = 64;
        Random rng = new Random(7);
        float[] w = new float[rows * cols];
        float[] x = new float[tokens * cols];
        float[] bias = new float[rows];
        float[] y0 = new float[tokens * rows];
        for (int i = 0; i < w.length; i++) {
            w[i] = rng.nextInt(17) - 8;
        }
        for (int i = 0; i < x.length; i++) {
            x[i] = rng.nextInt(255) - 127;
        }
        for (int i = 0; i < rows; i++) {
            bias[i] = rng.nextInt(100) - 50;
        }
        for (int i = 0; i < y0.length; i++) {
            y0[i] = rng.nextInt(1000);
        }
        ByteBuffer wb = NativeTestSupport.floats(w);
        ByteBuffer xb = NativeTestSupport.floats(x);
        ByteBuffer plain = NativeTestSupport.zeros(tokens * rows);
        ByteBuffer acc = NativeTestSupport.floats(y0);
        TaskGraph g = new TaskGraph("g")
                .task("mm", "matmul", F32, buf(wb, "w"), buf(xb, "x"), null, buf(plain, "plain"), (long) tokens,
                        (long) rows, (long) cols, false, null, null, null, 0.0f, null, null, null, null)
                .task("mm_bias_acc", "matmul", F32, buf(wb, "w"), buf(xb, "x"), buf(NativeTestSupport.floats(bias),
                        "bias"), buf(acc, "acc"), (long) tokens, (long) rows, (long) cols, 1, null, null, null, 0.0f,
                        null, null, null, null);
        run(g);
        float[] p = NativeTestSupport.readFloats(plain, tokens * rows);
        float[] a = NativeTestSupport.readFloats(acc, tokens * rows);
        for (int t = 0; t < tokens; t++) {
            for (int r = 0; r < rows; r++) {
                double dot = 0;
                for (int c = 0; c < cols; c++) {
                    dot += (double) w[r * cols + c] * x[t * cols + c];
                }
                assertEquals(dot, p[t * rows + r], 0.0);
                assertEquals(y0[t * rows + r] + (dot + bias[r]), a[t * rows + r], 0.0);
            }
        }
    }

    /** Weights q*d with d in {0.25, 0.5, 1, 2}; activations integers with |x| <= 127 and 127 in every block. */
    @Test
    public void matmulQ8_0IsExact() {
        int tokens = 2, rows = 6, cols = 96, blocks = cols / 32;
        Random rng = new Random(11);
        byte[] codes = new byte[rows * cols];
        short[] scales = new short[rows * blocks];
        int[] scaleIdx = new int[rows * blocks];
        for (int i = 0; i < codes.length; i++) {
            codes[i] = (byte) (rng.nextInt(255) - 127);
        }
        for (int i = 0; i < scales.length; i++) {
            scaleIdx[i] = rng.nextInt(FP16_BITS.length);
            scales[i] = FP16_BITS[scaleIdx[i]];
        }
        float[] x = new float[tokens * cols];
        for (int i = 0; i < x.length; i++) {
            x[i] = i % 32 == 0 ? 127f : rng.nextInt(255) - 127;
        }
        ByteBuffer y = NativeTestSupport.zeros(tokens * rows);
        run(new TaskGraph("g").task("mm", "matmul", Q8_0, buf(q8_0(rows, cols, scales, codes), "w"),
                buf(NativeTestSupport.floats(x), "x"), null, buf(y, "y"), (long) tokens, (long) rows,
                (long) cols, false, null, null, null, 0.0f, null, null, null, null));
        float[] got = NativeTestSupport.readFloats(y, tokens * rows);
        for (int t = 0; t < tokens; t++) {
            for (int r = 0; r < rows; r++) {
                double dot = 0;
                for (int c = 0; c < cols; c++) {
                    dot += codes[r * cols + c] * FP16_VALUES[scaleIdx[r * blocks + c / 32]] * x[t * cols + c];
                }
                assertEquals("t=" + t + " r=" + r, dot, got[t * rows + r], 0.0);
            }
        }
    }

    @Test
    public void argmaxTiesGoToTheLowestIdAndNaNNeverWins() {
        float nan = Float.NaN;
        float[] logits = {
            1f, 5f, 5f, nan, Float.NEGATIVE_INFINITY,   // tie 1/2 -> 1
            nan, nan, 2f, 2f, -1f,                      // NaN first, tie -> 2
            3f, 3f, 3f, 3f, 3f,                         // all equal -> 0
            -9f, -8f, -7f, -6f, Float.POSITIVE_INFINITY // +inf last -> 4
        };
        ByteBuffer out = NativeTestSupport.ints(-1, -1, -1, -1);
        run(new TaskGraph("g").task("argmax", "argmax", buf(NativeTestSupport.floats(logits), "logits"),
                buf(out, "out"), 4L, 5L));
        assertArrayEquals(new int[] {1, 2, 0, 4}, NativeTestSupport.readInts(out, 4));
    }

    @Test
    public void argmaxAdvanceChoosesThenMovesThePositionAndLogsTheToken() {
        ByteBuffer out = NativeTestSupport.ints(-1);
        ByteBuffer pos = NativeTestSupport.ints(2);
        ByteBuffer log = NativeTestSupport.ints(-1, -1, -1, -1, -1);
        run(new TaskGraph("g").task("argmax_advance", "argmax_advance",
                buf(NativeTestSupport.floats(new float[] {1f, 7f, 7f, -3f}), "logits"), buf(out, "out"), 4L,
                buf(pos, "pos"), 2L, buf(log, "log"), 5L));
        assertArrayEquals(new int[] {1}, NativeTestSupport.readInts(out, 1));  // the tie goes to the lower id
        assertArrayEquals(new int[] {4}, NativeTestSupport.readInts(pos, 1));
        assertArrayEquals(new int[] {-1, -1, -1, -1, 1}, NativeTestSupport.readInts(log, 5));
    }

    /**
     * The values a Q8_0 product multiplies for the finite activations h (csrc/common/act_quant.h): per group of 4,
     * rint(v * 2^-e) * 2^e, 2^e the smallest power of two that puts the group's largest |v| below 127.5; groups
     * below 2^-100 are 0.
     */
    private static double[] q8Round(float[] h) {
        double[] out = new double[h.length];
        for (int j = 0; j < h.length; j += 4) {
            float amax = 0f;
            for (int i = 0; i < 4; i++) {
                amax = Math.max(amax, Math.abs(h[j + i]));
            }
            if (amax < 0x1p-100f) {
                continue;
            }
            int e = Math.getExponent(amax) - 6;  // amax * 2^-e in [64, 128)
            if (Math.scalb(amax, -e) >= 127.5f) {
                e++;
            }
            for (int i = 0; i < 4; i++) {
                out[j + i] = Math.scalb(Math.rint(Math.scalb(h[j + i], -e)), e);
            }
        }
        return out;
    }

    /** embedding -> rmsnorm -> Q8_0 matmul -> argmax in one graph, against a double reference. */
    @Test
    public void pipelineMatchesDoubleReference() {
        int vocab = 7, dim = 64, outRows = 9, blocks = dim / 32;
        Random rng = new Random(3);
        float[] table = new float[vocab * dim];
        for (int i = 0; i < table.length; i++) {
            table[i] = (float) rng.nextGaussian();
        }
        float[] normW = new float[dim];
        for (int i = 0; i < dim; i++) {
            normW[i] = (float) (0.75 + 0.5 * rng.nextDouble());
        }
        byte[] codes = new byte[outRows * dim];
        short[] scales = new short[outRows * blocks];
        int[] scaleIdx = new int[outRows * blocks];
        for (int i = 0; i < codes.length; i++) {
            codes[i] = (byte) (rng.nextInt(255) - 127);
        }
        for (int i = 0; i < scales.length; i++) {
            scaleIdx[i] = rng.nextInt(FP16_BITS.length);
            scales[i] = FP16_BITS[scaleIdx[i]];
        }
        int token = 5;
        ByteBuffer x = NativeTestSupport.zeros(dim);
        ByteBuffer h = NativeTestSupport.zeros(dim);
        ByteBuffer logits = NativeTestSupport.zeros(outRows);
        ByteBuffer next = NativeTestSupport.ints(-1);
        DeviceBuffer xb = buf(x, "x");
        DeviceBuffer hb = buf(h, "h");
        DeviceBuffer lb = buf(logits, "logits");
        TaskGraph g = new TaskGraph("step")
                .transferToDevice(DataTransferMode.EVERY_EXECUTION, buf(NativeTestSupport.ints(token), "ids"))
                .task("embedding", "embedding", F32, buf(NativeTestSupport.floats(table), "table"),
                        buf(NativeTestSupport.ints(token), "ids"), xb, 1L, (long) vocab, (long) dim)
                .task("norm", "rmsnorm", xb, buf(NativeTestSupport.floats(normW), "norm_w"), hb, 1L, (long) dim,
                        1e-6f)
                .task("output", "matmul", Q8_0, buf(q8_0(outRows, dim, scales, codes), "output_w"), hb, null, lb,
                        1L, (long) outRows, (long) dim, false, null, null, null, 0.0f, null, null, null, null)
                .task("argmax", "argmax", lb, buf(next, "next"), 1L, (long) outRows)
                .transferToHost(DataTransferMode.EVERY_EXECUTION, buf(next, "next"));
        run(g);

        double ss = 0;
        for (int c = 0; c < dim; c++) {
            ss += (double) table[token * dim + c] * table[token * dim + c];
        }
        double inv = 1.0 / Math.sqrt(ss / dim + 1e-6f);
        float[] hn = new float[dim];
        for (int c = 0; c < dim; c++) {
            hn[c] = (float) (table[token * dim + c] * inv * normW[c]);
        }
        double[] hq = q8Round(hn);  // a Q8_0 product multiplies h's int8 groups
        double[] ref = new double[outRows];
        int best = 0;
        for (int r = 0; r < outRows; r++) {
            for (int c = 0; c < dim; c++) {
                ref[r] += codes[r * dim + c] * FP16_VALUES[scaleIdx[r * blocks + c / 32]] * hq[c];
            }
            if (ref[r] > ref[best]) {
                best = r;
            }
        }
        float[] got = NativeTestSupport.readFloats(logits, outRows);
        double scale = 0;
        for (double v : ref) {
            scale = Math.max(scale, Math.abs(v));
        }
        for (int r = 0; r < outRows; r++) {
            assertEquals("logit " + r, ref[r], got[r], 1e-5 * scale);
        }
        for (int r = 0; r < outRows; r++) {
            assertTrue("reference argmax needs a margin", r == best || ref[best] - ref[r] > 1e-3 * scale);
        }
        assertEquals(best, NativeTestSupport.readInts(next, 1)[0]);
    }

    @Test
    public void kernelErrorsNameGraphTaskAndKernel() {
        ByteBuffer x = NativeTestSupport.zeros(4);
        TaskGraph g = new TaskGraph("layer2").task("attn_norm", "rmsnorm", buf(x, "x"), buf(x, "w"), buf(x, "y"),
                1L, 0L, 1e-6f);
        try (TornadoExecutionPlan plan = new TornadoExecutionPlan(g.snapshot())) {
            TornadoKernelException e = assertThrows(TornadoKernelException.class, plan::execute);
            assertEquals(TornadoKernelException.INVALID_ARGUMENT, e.getStatus());
            assertTrue(e.getMessage(), e.getMessage().startsWith(
                    "task graph 'layer2', task 'attn_norm' (kernel 'rmsnorm'): tm_invoke failed (status -1): ")
                    && e.getMessage().contains("'dim' must be > 0"));
        }
    }

    @Test
    public void cudaPlansWithoutCudaFailCleanly() {
        org.junit.Assume.assumeTrue("a CUDA device is present: the no-CUDA error path is not reachable",
                !NativeKernels.cudaCompiled() || NativeKernels.cudaDeviceCount() == 0);
        // Fake device addresses: the library refuses before touching them.
        DeviceBuffer a = DeviceBuffer.wrap(0x10000, 256, Device.CUDA, "a");
        DeviceBuffer b = DeviceBuffer.wrap(0x20000, 256, Device.CUDA, "b");
        TaskGraph g = new TaskGraph("gpu").task("argmax", "argmax", a, b, 1L, 8L);
        try (TornadoExecutionPlan plan = new TornadoExecutionPlan(g.snapshot())) {
            TornadoKernelException e = assertThrows(TornadoKernelException.class, plan::execute);
            assertEquals(TornadoKernelException.NO_CUDA, e.getStatus());
            assertTrue(e.getMessage(), e.getMessage().contains("task 'argmax'"));
            plan.withCUDAGraph();
            IllegalStateException s = assertThrows(IllegalStateException.class, plan::execute);
            assertTrue(s.getMessage(), s.getMessage().contains("legacy default stream"));
            plan.withStream(0x1234);
            TornadoKernelException capture = assertThrows(TornadoKernelException.class, plan::execute);
            assertEquals(TornadoKernelException.NO_CUDA, capture.getStatus());
            assertTrue(!plan.hasCUDAGraph());
        }
    }
}
