"""What a run reports: the console, metrics and FLOPs, the memory estimate, the MFU peak, summary.json. These sit
above runtime/ and may read the model, the layout and the registries; the measurements they report come from
nanoexp/instruments/."""
