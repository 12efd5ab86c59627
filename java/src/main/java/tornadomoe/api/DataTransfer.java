package tornadomoe.api;

import java.util.Collections;
import java.util.List;

import tornadomoe.runtime.DeviceBuffer;

/** A recorded transfer declaration of a task graph: direction, mode and buffers. */
public final class DataTransfer {
    /** Direction of a transfer. */
    public enum Direction { TO_DEVICE, TO_HOST }

    private final Direction direction;
    private final int mode;
    private final List<DeviceBuffer> buffers;

    DataTransfer(Direction direction, int mode, List<DeviceBuffer> buffers) {
        this.direction = direction;
        this.mode = mode;
        this.buffers = Collections.unmodifiableList(buffers);
    }

    public Direction getDirection() {
        return direction;
    }

    /** One of the {@link DataTransferMode} constants. */
    public int getMode() {
        return mode;
    }

    public List<DeviceBuffer> getBuffers() {
        return buffers;
    }

    @Override
    public String toString() {
        return direction + "(" + DataTransferMode.name(mode) + ", " + buffers + ")";
    }
}
