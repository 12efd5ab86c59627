package tornadomoe.api;

import java.util.Arrays;

import tornadomoe.runtime.Kernel;
import tornadomoe.runtime.KernelArguments;

/** One task of a graph: exactly one launch of one kernel with arguments already checked and packed. */
public final class Task {
    private final String name;
    private final Object[] arguments;
    private final KernelArguments packed;

    Task(String name, Object[] arguments, KernelArguments packed) {
        this.name = name;
        this.arguments = arguments;
        this.packed = packed;
    }

    public String getName() {
        return name;
    }

    public Kernel getKernel() {
        return packed.kernel();
    }

    public String getKernelName() {
        return packed.kernel().name();
    }

    /** The arguments as given (a copy). */
    public Object[] getArguments() {
        return arguments.clone();
    }

    /** The arguments packed for tm_invoke. */
    public KernelArguments getPackedArguments() {
        return packed;
    }

    @Override
    public String toString() {
        return name + " = " + packed.kernel().name() + Arrays.toString(arguments);
    }
}
