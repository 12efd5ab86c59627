package tornadomoe.runtime;

import java.nio.ByteBuffer;
import java.util.Objects;

/**
 * A handle on memory the kernels read or write: a raw address, its size in bytes, the device it lives on and
 * a label naming its owner (for error messages).
 *
 * <p>The memory is not owned by this object: on the Python route it belongs to a torch tensor, which Python
 * keeps alive for as long as the plan runs. When the owner frees it, it marks the handle {@link #release()
 * released}; a task that uses a released buffer is then refused (at {@code task()} time or when a plan
 * executes) instead of letting a kernel touch freed memory.
 */
public final class DeviceBuffer {
    private final long address;
    private final long bytes;
    private final Device device;
    private final String owner;
    /** Keeps a wrapped direct ByteBuffer reachable, so the GC does not free its memory under the kernels. */
    private final Object keepAlive;
    private volatile boolean released;

    private DeviceBuffer(long address, long bytes, Device device, String owner, Object keepAlive) {
        this.address = address;
        this.bytes = bytes;
        this.device = device;
        this.owner = owner;
        this.keepAlive = keepAlive;
    }

    /**
     * Wraps memory owned elsewhere (e.g. a torch tensor's {@code data_ptr()}).
     *
     * @throws IllegalArgumentException for a null address, a negative size or a null device
     */
    public static DeviceBuffer wrap(long address, long bytes, Device device, String owner) {
        Objects.requireNonNull(device, "device");
        String label = owner == null ? "<unnamed>" : owner;
        if (address == 0) {
            throw new IllegalArgumentException("buffer '" + label + "': null address");
        }
        if (bytes < 0) {
            throw new IllegalArgumentException("buffer '" + label + "': negative size " + bytes);
        }
        return new DeviceBuffer(address, bytes, device, label, null);
    }

    /**
     * Wraps a direct ByteBuffer (host memory, {@link Device#CPU}) from its start to its capacity. The handle
     * keeps the ByteBuffer reachable. Needs the JNI library (to read the address).
     */
    public static DeviceBuffer wrapDirect(ByteBuffer buffer, String owner) {
        Objects.requireNonNull(buffer, "buffer");
        if (!buffer.isDirect()) {
            throw new IllegalArgumentException("buffer '" + owner + "': not a direct ByteBuffer (use allocateDirect)");
        }
        NativeLibrary.load();
        long address = NativeKernels.addressOf(buffer);
        DeviceBuffer b = wrap(address, buffer.capacity(), Device.CPU, owner);
        return new DeviceBuffer(b.address, b.bytes, b.device, b.owner, buffer);
    }

    public long getAddress() {
        return address;
    }

    public long getBytes() {
        return bytes;
    }

    public Device getDevice() {
        return device;
    }

    public String getOwner() {
        return owner;
    }

    /** Marks the memory as gone: tasks using this buffer are refused from now on. Idempotent. */
    public void release() {
        released = true;
    }

    public boolean isReleased() {
        return released;
    }

    @Override
    public String toString() {
        return "DeviceBuffer['" + owner + "', " + device + ", 0x" + Long.toHexString(address) + ", " + bytes
                + " bytes" + (released ? ", released" : "") + "]";
    }
}
