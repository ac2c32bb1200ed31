import os
import sys
import warnings

sys.path.insert(0, os.path.dirname(__file__))
# megatron-core warns at import that Transformer Engine / Apex are absent (expected on CPU)
warnings.filterwarnings("ignore", message=".*Transformer Engine and Apex are not installed.*")
