"""The wire layer shared by the client and the daemon: frames, messages, error codes and the
shared memory regions that carry bulk data. Nothing here does I/O on its own account except the
region's descriptor passing."""
