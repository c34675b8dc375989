"""One rank's side of a step: the worker, its model runner, sampler, CUDA-graph holders, host staging and weight loading."""
