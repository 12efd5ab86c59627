package tornadomoe.runtime;

import static org.junit.Assert.assertEquals;
import static org.junit.Assert.assertFalse;
import static org.junit.Assert.assertNotEquals;
import static org.junit.Assert.assertSame;
import static org.junit.Assert.assertThrows;
import static org.junit.Assert.assertTrue;

import java.nio.ByteBuffer;
import java.util.Arrays;
import java.util.LinkedHashMap;
import java.util.Map;

import org.junit.Before;
import org.junit.Test;

/** The native kernel table and the small natives, through the real JNI library. */
public class NativeKernelTableTest {
    @Before
    public void needsNativeLibrary() {
        NativeTestSupport.assumeNativeLibrary();
    }

    /**
     * Signatures derived by hand from the prototypes in tornado_moe.h (one letter per parameter between
     * device and stream), so a table that drifts from the header fails here.
     */
    private static Map<String, String> headerSignatures() {
        Map<String, String> m = new LinkedHashMap<>();
        m.put("embedding", "qpppiii");          // qtype, table, ids, out, n_tokens, vocab, dim
        m.put("rmsnorm", "pppiif");             // x, w, y, n_tokens, dim, eps
        m.put("rmsnorm_factors", "pppnpiif");   // x, w, xw, xss?, inv, n_tokens, dim, eps
        m.put("matmul", "qppnpiiibnnnfnnnn");   // qtype, w, x, bias?, y, n_tokens, rows, cols, accumulate, scale?,
                                                // x_groups?, x_sums?, eps, next_norm_w?, y_w?, y_ss?,
                                                // y_w_groups?
        m.put("rope_kv_append", "ppppppiiiiifb"); // q k v k_cache v_cache pos, T, heads, kv, hd, ctx, base, neox
        m.put("qkv_rope", "qpnnpfpppnnnppppiiiiiifbn"); // qtype x xw? xss? norm_w eps, w_q w_k w_v, b_q? b_k? b_v?,
                                                       // q k_cache v_cache pos, T hidden heads kv hd ctx, base,
                                                       // neox, xw_groups?
        m.put("attention", "pppppiiiiipn");     // q k_cache v_cache out pos, T heads kv hd ctx, scratch,
                                                // out_groups?
        m.put("router_topk", "ppppiiiib");      // w_router h ids weights, T E hidden top_k, normalize
        m.put("rmsnorm_router_topk", "ppfppppiiiib"); // x norm_w eps h w_router ids weights, T E hidden top_k, norm
        m.put("moe_gate_up", "qpppnpiiiiiiin"); // qtype gate up h ids? act, T top_k s0 n E ffn hidden, scale?
        m.put("experts_gate_up", "qpppipppppiiiii"); // qtype, shared gate up act ffn, gate up h ids act, 5 ints
        m.put("router_experts_gate_up", "ppfppppqpppinnpppiiiibipnnnnn"); // x norm_w eps h w_router ids
                                                                       // weights, qtype, shared gate up act ffn
                                                                       // gate_inp? gate?, gate up act, T E
                                                                       // hidden top_k, normalize, ffn, scratch,
                                                                       // act_groups_sh? act_groups?, xw? xss?
                                                                       // xw_groups?
        m.put("router_experts_ffn", "ppfppppqppppinnppppiiiibipnnn"); // x norm_w eps h w_router ids weights,
                                                                   // qtype, shared gate up down act ffn
                                                                   // gate_inp? gate?, gate up down act, T E
                                                                   // hidden top_k, normalize, ffn, scratch,
                                                                   // xw? xss? xw_groups?
        m.put("moe_down_accumulate", "qppnnnnpiiiiiii"); // qtype down act ids? w? gate_inp? h? x, 7 ints
        m.put("experts_down_accumulate", "qppnnipppnnpnnniiiiinnn"); // qtype, shared down act gate_inp? gate?
                                                                 // ffn, down act ids weights? h? x next_norm_w?
                                                                 // xw? xss?, 5 ints, act_groups_sh? act_groups?
                                                                 // xw_groups?
        m.put("argmax", "ppii");                // logits out n_tokens vocab
        m.put("sample", "ppiffiup");            // logits out vocab temp top_p top_k seed step
        m.put("advance_position", "pinni");     // pos delta token log log_len
        m.put("argmax_advance", "ppipini");     // logits out vocab pos delta log? log_len
        return m;
    }

    @Test
    public void tableMatchesTheHeader() {
        KernelSet set = KernelSet.nativeSet();
        assertSame("read once", set, KernelSet.nativeSet());
        assertEquals(NativeKernels.kernelCount(), set.size());
        for (Map.Entry<String, String> e : headerSignatures().entrySet()) {
            Kernel k = KernelSet.get(e.getKey());
            assertEquals(e.getKey(), e.getValue(), k.signature());
            assertEquals(e.getKey(), NativeKernels.kernelName(k.index()));
        }
        for (int i = 0; i < set.size(); i++) {
            assertEquals(i, set.kernels().get(i).index());
        }
    }

    @Test
    public void unknownKernelListsTheNativeOnes() {
        IllegalArgumentException e = assertThrows(IllegalArgumentException.class, () -> KernelSet.get("foo"));
        assertTrue(e.getMessage(), e.getMessage().startsWith("unknown kernel 'foo' (known: ")
                && e.getMessage().contains("rmsnorm") && e.getMessage().contains("moe_down_accumulate"));
    }

    @Test
    public void outOfRangeIndicesAndInvokeFailuresThrowTornadoKernelException() {
        TornadoKernelException name = assertThrows(TornadoKernelException.class,
                () -> NativeKernels.kernelName(NativeKernels.kernelCount()));
        assertEquals(TornadoKernelException.UNKNOWN_KERNEL, name.getStatus());
        TornadoKernelException invoke = assertThrows(TornadoKernelException.class,
                () -> NativeKernels.invoke(-1, 0, new long[0], 0));
        assertEquals(TornadoKernelException.UNKNOWN_KERNEL, invoke.getStatus());
        assertTrue(invoke.getMessage(), invoke.getMessage().contains("tm_invoke")
                && invoke.getMessage().contains("unknown kernel index -1"));
        Kernel argmax = KernelSet.get("argmax");
        TornadoKernelException words = assertThrows(TornadoKernelException.class,
                () -> NativeKernels.invoke(argmax.index(), 0, new long[] {1, 2}, 0));
        assertEquals(TornadoKernelException.INVALID_ARGUMENT, words.getStatus());
        assertThrows(IllegalArgumentException.class, () -> NativeKernels.invoke(argmax.index(), 0, null, 0));
    }

    @Test
    public void deviceQueriesAreConsistent() {
        int count = NativeKernels.cudaDeviceCount();
        assertTrue(count >= 0);
        if (!NativeKernels.cudaCompiled()) {
            assertEquals(0, count);
        }
        assertFalse(NativeKernels.version().isEmpty());
        NativeKernels.synchronize(Device.CPU.id(), 0);
        TornadoKernelException bad = assertThrows(TornadoKernelException.class, () -> NativeKernels.synchronize(9, 0));
        assertEquals(TornadoKernelException.INVALID_ARGUMENT, bad.getStatus());
    }

    @Test
    public void addressOfDirectBuffersOnly() {
        ByteBuffer direct = ByteBuffer.allocateDirect(64);
        long a = NativeKernels.addressOf(direct);
        assertNotEquals(0, a);
        assertEquals(a, NativeKernels.addressOf(direct));
        assertThrows(IllegalArgumentException.class, () -> NativeKernels.addressOf(ByteBuffer.allocate(64)));
        assertThrows(IllegalArgumentException.class, () -> NativeKernels.addressOf(null));
        DeviceBuffer b = DeviceBuffer.wrapDirect(direct, "direct");
        assertEquals(a, b.getAddress());
        assertEquals(64, b.getBytes());
        assertEquals(Device.CPU, b.getDevice());
        assertThrows(IllegalArgumentException.class, () -> DeviceBuffer.wrapDirect(ByteBuffer.allocate(8), "heap"));
        assertEquals(Arrays.asList("direct"), Arrays.asList(b.getOwner()));
    }
}
