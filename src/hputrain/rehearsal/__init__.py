"""Rehearsing a Gaudi run on any machine: the doctor (lazy mode on the CPU: recompilations, host
syncs, fallbacks)."""
