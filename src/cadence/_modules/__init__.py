"""What the wrappers share about the user's ``nn.Module`` (private): ``conversions``
(the nn.Module conversions a wrapper intercepts). Nothing is imported here.
"""
