"""Number formats: the autocast policy of model.dtype (precision.py), and converters of the linears."""
