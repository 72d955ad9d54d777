"""Number formats: the autocast policy of model.dtype (precision.py) and the converters of the linears
(converters.py), among them FP8 (fp8.py, registered on import)."""
from nanoexp.numerics import fp8  # noqa: F401 - registers the "fp8" converter
