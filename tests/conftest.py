import os
import sys

import torch

# Tests run several gloo ranks on 2 cores: keep each process to one thread.
torch.set_num_threads(1)
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
