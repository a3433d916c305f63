"""What every command and engine shares: the error type and the CLI edge, how processes end, the console, folder
locks, the file layer (local paths and ``gs://``), optional dependencies and network addresses."""
