"""The gradient-timing protocol and its helpers (private).

``timing`` holds `GradientTiming` (the verbs every wrapper implements) and
`ShardedTiming`; ``torch_timing`` gives torch's own DDP and FSDP2 the same verbs;
``pending_grad`` keeps ``.grad`` unreadable until finalization writes it;
``overlap_optimizer`` steps an optimizer part by part as reductions land; ``autograd``
wraps the private autograd-engine hooks the wrappers need. Nothing is imported here.
"""
