"""Serving on this machine: process groups, the PD stack through the launch scripts, `flashmemory serve`."""
