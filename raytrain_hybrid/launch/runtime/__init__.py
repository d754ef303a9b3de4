"""What starts and drives a run: Ray (the session, the driver, the workers' entry, the backend,
elastic and autoscaling, the fault-tolerant groups) or torchrun, and the CLI's quiet wrapper;
also the start (launch.runtime.start) and `check`'s dry start, which join a named cluster to
read it. Reads launch.plan, writes through launch.records."""
