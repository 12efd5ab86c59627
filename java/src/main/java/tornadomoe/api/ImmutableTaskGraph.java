package tornadomoe.api;

import java.util.ArrayList;
import java.util.Collections;
import java.util.IdentityHashMap;
import java.util.List;
import java.util.Map;

import tornadomoe.runtime.DeviceBuffer;

/** A frozen task graph (TornadoVM's ImmutableTaskGraph): what an execution plan runs. */
public final class ImmutableTaskGraph {
    private final String name;
    private final List<Task> tasks;
    private final List<DataTransfer> transfers;

    ImmutableTaskGraph(String name, List<Task> tasks, List<DataTransfer> transfers) {
        this.name = name;
        this.tasks = Collections.unmodifiableList(tasks);
        this.transfers = Collections.unmodifiableList(transfers);
    }

    public String getTaskGraphName() {
        return name;
    }

    public List<Task> getTasks() {
        return tasks;
    }

    public Task getTask(int index) {
        if (index < 0 || index >= tasks.size()) {
            throw new IndexOutOfBoundsException("task graph '" + name + "' has " + tasks.size()
                    + " tasks, no task " + index);
        }
        return tasks.get(index);
    }

    public int getTaskCount() {
        return tasks.size();
    }

    public List<DataTransfer> getTransfers() {
        return transfers;
    }

    /** Every distinct buffer the tasks and transfers use, in first-use order. */
    public List<DeviceBuffer> getBuffers() {
        Map<DeviceBuffer, Boolean> seen = new IdentityHashMap<>();
        List<DeviceBuffer> out = new ArrayList<>();
        for (Task t : tasks) {
            for (DeviceBuffer b : t.getPackedArguments().buffers()) {
                if (seen.put(b, Boolean.TRUE) == null) {
                    out.add(b);
                }
            }
        }
        for (DataTransfer d : transfers) {
            for (DeviceBuffer b : d.getBuffers()) {
                if (seen.put(b, Boolean.TRUE) == null) {
                    out.add(b);
                }
            }
        }
        return out;
    }

    @Override
    public String toString() {
        return "ImmutableTaskGraph['" + name + "', " + tasks.size() + " tasks]";
    }
}
