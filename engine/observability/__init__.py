"""What the engine reports about itself: metrics, the step profiler, hop tracing and GC-pause control."""
