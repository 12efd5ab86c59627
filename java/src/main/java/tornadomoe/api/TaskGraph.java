package tornadomoe.api;

import java.util.ArrayList;
import java.util.LinkedHashSet;
import java.util.List;
import java.util.Objects;
import java.util.Set;

import tornadomoe.runtime.DeviceBuffer;
import tornadomoe.runtime.Kernel;
import tornadomoe.runtime.KernelArguments;
import tornadomoe.runtime.KernelSet;

/**
 * A task graph under construction (TornadoVM's TaskGraph): an ordered list of tasks, one kernel launch each,
 * plus transfer declarations. Every task is validated when it is declared, against the kernel's signature
 * in the kernel table; {@link #snapshot()} freezes the graph for an execution plan.
 *
 * <pre>{@code
 * TaskGraph g = new TaskGraph("layer0")
 *     .transferToDevice(DataTransferMode.EVERY_EXECUTION, x)
 *     .task("attn_norm", "rmsnorm", x, w, h, 1L, 2048L, 1e-6f);
 * ImmutableTaskGraph ig = g.snapshot();
 * }</pre>
 */
public class TaskGraph {
    private final String name;
    private final KernelSet kernels;
    private final List<Task> tasks = new ArrayList<>();
    private final Set<String> taskNames = new LinkedHashSet<>();
    private final List<DataTransfer> transfers = new ArrayList<>();

    /** A graph over the native kernel table (loaded on the first task). */
    public TaskGraph(String name) {
        this(name, null);
    }

    /** A graph over the given kernel table ({@code null}: the native one). */
    public TaskGraph(String name, KernelSet kernels) {
        Objects.requireNonNull(name, "task graph name");
        if (name.isEmpty()) {
            throw new IllegalArgumentException("task graph name must not be empty");
        }
        this.name = name;
        this.kernels = kernels;
    }

    /**
     * Adds one launch of {@code kernelName} with {@code args} in C ABI order, without {@code device} and
     * {@code stream}.
     *
     * @throws IllegalArgumentException for a duplicate task name, an unknown kernel, a wrong argument count
     *     or an argument of the wrong type (the message names graph, task, kernel and argument index)
     */
    public TaskGraph task(String taskName, String kernelName, Object... args) {
        Objects.requireNonNull(taskName, "task name");
        Objects.requireNonNull(kernelName, "kernel name");
        // task("t", "k", null) passes a null array: read it as one null argument, as the caller meant.
        Object[] values = args == null ? new Object[] {null} : args.clone();
        String context = "task graph '" + name + "', task '" + taskName + "'";
        if (taskNames.contains(taskName)) {
            throw new IllegalArgumentException(context + ": duplicate task name");
        }
        KernelSet table = kernels != null ? kernels : KernelSet.nativeSet();
        Kernel kernel;
        try {
            kernel = table.kernel(kernelName);
        } catch (IllegalArgumentException e) {
            throw new IllegalArgumentException(context + ": " + e.getMessage(), e);
        }
        KernelArguments packed = KernelArguments.pack(kernel, values, context);
        tasks.add(new Task(taskName, values, packed));
        taskNames.add(taskName);
        return this;
    }

    /** Declares inputs the graph reads (recorded; buffers are device memory already). */
    public TaskGraph transferToDevice(int mode, Object... buffers) {
        transfers.add(new DataTransfer(DataTransfer.Direction.TO_DEVICE, checkMode(mode),
                checkBuffers("transferToDevice", buffers)));
        return this;
    }

    /** Declares outputs the host reads after an execution (recorded; buffers are device memory already). */
    public TaskGraph transferToHost(int mode, Object... buffers) {
        transfers.add(new DataTransfer(DataTransfer.Direction.TO_HOST, checkMode(mode),
                checkBuffers("transferToHost", buffers)));
        return this;
    }

    private static int checkMode(int mode) {
        DataTransferMode.name(mode);
        return mode;
    }

    private List<DeviceBuffer> checkBuffers(String what, Object[] buffers) {
        List<DeviceBuffer> out = new ArrayList<>();
        Object[] values = buffers == null ? new Object[] {null} : buffers;
        for (int i = 0; i < values.length; i++) {
            Object b = values[i];
            if (!(b instanceof DeviceBuffer)) {
                throw new IllegalArgumentException("task graph '" + name + "': " + what + " argument " + i
                        + " must be a DeviceBuffer, got " + (b == null ? "null" : b.getClass().getName()));
            }
            if (((DeviceBuffer) b).isReleased()) {
                throw new IllegalArgumentException("task graph '" + name + "': " + what + " argument " + i
                        + " is a released buffer " + b);
            }
            out.add((DeviceBuffer) b);
        }
        return out;
    }

    /** Freezes the current tasks and transfers; later changes to this graph do not affect the snapshot. */
    public ImmutableTaskGraph snapshot() {
        return new ImmutableTaskGraph(name, new ArrayList<>(tasks), new ArrayList<>(transfers));
    }

    public String getTaskGraphName() {
        return name;
    }

    public int getTaskCount() {
        return tasks.size();
    }
}
