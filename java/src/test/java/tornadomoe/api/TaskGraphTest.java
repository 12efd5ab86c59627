package tornadomoe.api;

import static org.junit.Assert.assertArrayEquals;
import static org.junit.Assert.assertEquals;
import static org.junit.Assert.assertNull;
import static org.junit.Assert.assertSame;
import static org.junit.Assert.assertThrows;
import static org.junit.Assert.assertTrue;

import java.util.Arrays;

import org.junit.Test;

import tornadomoe.runtime.Device;
import tornadomoe.runtime.DeviceBuffer;
import tornadomoe.runtime.KernelSet;
import tornadomoe.runtime.NativeTestSupport;

/** Building task graphs and every validation error of task(), on a table built here (no native code). */
public class TaskGraphTest {
    private final KernelSet table = NativeTestSupport.letterTable(); // all_letters qpnibfu, copy ppi, scale ppif
    private final DeviceBuffer x = NativeTestSupport.fake(0x1000, Device.CPU, "x");
    private final DeviceBuffer y = NativeTestSupport.fake(0x2000, Device.CPU, "y");
    private final DeviceBuffer z = NativeTestSupport.fake(0x3000, Device.CPU, "z");

    @Test
    public void buildsTasksInOrderAndSnapshotsAreFrozen() {
        TaskGraph g = new TaskGraph("layer0", table)
                .transferToDevice(DataTransferMode.EVERY_EXECUTION, x)
                .task("copy0", "copy", x, y, 16L)
                .task("scale0", "scale", y, z, 16, 0.5f)
                .transferToHost(DataTransferMode.EVERY_EXECUTION, z);
        ImmutableTaskGraph snap = g.snapshot();
        g.task("copy1", "copy", z, x, 16L);

        assertEquals("layer0", snap.getTaskGraphName());
        assertEquals(2, snap.getTaskCount());
        assertEquals(3, g.getTaskCount());
        assertEquals("copy0", snap.getTask(0).getName());
        assertEquals("scale", snap.getTask(1).getKernelName());
        assertArrayEquals(new Object[] {y, z, 16, 0.5f}, snap.getTask(1).getArguments());
        assertArrayEquals(new long[] {0x2000, 0x3000, 16, Float.floatToRawIntBits(0.5f)},
                snap.getTask(1).getPackedArguments().words());
        assertEquals(Arrays.asList(x, y, z), snap.getBuffers());
        assertEquals(2, snap.getTransfers().size());
        assertEquals(DataTransfer.Direction.TO_DEVICE, snap.getTransfers().get(0).getDirection());
        assertEquals(DataTransferMode.EVERY_EXECUTION, snap.getTransfers().get(1).getMode());
        assertSame(z, snap.getTransfers().get(1).getBuffers().get(0));
        assertThrows(UnsupportedOperationException.class, () -> snap.getTasks().clear());
        assertThrows(IndexOutOfBoundsException.class, () -> snap.getTask(2));
    }

    @Test
    public void duplicateTaskNameIsRejected() {
        TaskGraph g = new TaskGraph("g", table).task("t", "copy", x, y, 1L);
        IllegalArgumentException e = assertThrows(IllegalArgumentException.class, () -> g.task("t", "copy", y, x, 1L));
        assertEquals("task graph 'g', task 't': duplicate task name", e.getMessage());
        assertEquals(1, g.getTaskCount());
    }

    @Test
    public void unknownKernelNamesTheKnownOnes() {
        TaskGraph g = new TaskGraph("g", table);
        IllegalArgumentException e = assertThrows(IllegalArgumentException.class, () -> g.task("t", "foo", x));
        assertEquals("task graph 'g', task 't': unknown kernel 'foo' (known: all_letters, copy, scale)", e.getMessage());
    }

    @Test
    public void wrongArgumentCountAndTypeNameGraphTaskKernelAndIndex() {
        TaskGraph g = new TaskGraph("layer3", table);
        IllegalArgumentException count = assertThrows(IllegalArgumentException.class,
                () -> g.task("norm", "scale", x, y, 4L));
        assertTrue(count.getMessage(), count.getMessage().startsWith(
                "task graph 'layer3', task 'norm' (kernel 'scale', signature 'ppif'): expected 4 arguments"));
        IllegalArgumentException type = assertThrows(IllegalArgumentException.class,
                () -> g.task("norm", "scale", x, y, 4L, "eps"));
        assertTrue(type.getMessage(), type.getMessage().contains("task 'norm'")
                && type.getMessage().contains("argument 3 expects a float32")
                && type.getMessage().contains("java.lang.String eps"));
        IllegalArgumentException nul = assertThrows(IllegalArgumentException.class,
                () -> g.task("norm", "scale", x, null, 4L, 1f));
        assertTrue(nul.getMessage(), nul.getMessage().contains("argument 1 expects a buffer ('p'")
                && nul.getMessage().endsWith("got null"));
        assertEquals("failed declarations leave no task behind", 0, g.getTaskCount());
    }

    @Test
    public void releasedBufferIsRejectedAtTask() {
        y.release();
        TaskGraph g = new TaskGraph("g", table);
        IllegalArgumentException e = assertThrows(IllegalArgumentException.class, () -> g.task("t", "copy", x, y, 1L));
        assertTrue(e.getMessage(), e.getMessage().contains("argument 1") && e.getMessage().contains("released"));
        assertThrows(IllegalArgumentException.class, () -> g.transferToHost(DataTransferMode.EVERY_EXECUTION, y));
    }

    @Test
    public void nullVarargsIsOneNullArgument() {
        TaskGraph g = new TaskGraph("g", new KernelSet(Arrays.asList(new tornadomoe.runtime.Kernel("opt", 0, "n"))));
        g.task("t", "opt", (Object[]) null);
        assertNull(g.snapshot().getTask(0).getArguments()[0]);
        assertEquals(0L, g.snapshot().getTask(0).getPackedArguments().words()[0]);
    }

    @Test
    public void transferDeclarationsAreChecked() {
        TaskGraph g = new TaskGraph("g", table);
        IllegalArgumentException mode = assertThrows(IllegalArgumentException.class, () -> g.transferToDevice(7, x));
        assertTrue(mode.getMessage(), mode.getMessage().contains("unknown data transfer mode 7"));
        IllegalArgumentException type = assertThrows(IllegalArgumentException.class,
                () -> g.transferToDevice(DataTransferMode.FIRST_EXECUTION, x, 3L));
        assertTrue(type.getMessage(), type.getMessage().contains("argument 1 must be a DeviceBuffer"));
        assertEquals("FIRST_EXECUTION", DataTransferMode.name(DataTransferMode.FIRST_EXECUTION));
    }

    @Test
    public void graphNameMustBeNonEmpty() {
        assertThrows(IllegalArgumentException.class, () -> new TaskGraph(""));
        assertThrows(NullPointerException.class, () -> new TaskGraph(null));
    }
}
