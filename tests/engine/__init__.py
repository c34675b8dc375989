"""The engine end to end on CPU: models, loader, sampler, scheduler in a step, offline and async APIs."""
