"""Pure converters between other tools' formats and mltrace's events: profiles (ONNX Runtime's
JSON, TensorFlow's XSpace), library verbose lines, FLOP counting rules, CUDA API names. They
read and return data only; the live sources (``tracer/sources/``) and the importers call them."""
