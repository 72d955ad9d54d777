"""Number formats: the autocast policy of model.dtype (precision.py) and the converters of the linears
(converters.py)."""
