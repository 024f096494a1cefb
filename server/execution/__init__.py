"""Model execution: the compute thread (compute_thread.py), the model runners behind one protocol
(runner.py; loader.py picks one per checkpoint), their compiled steps and the background compiler that
builds them (compiler.py)."""
