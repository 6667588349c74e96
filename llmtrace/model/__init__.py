"""Layer model: the transformer's forward pass, its compiled decode step and the quantized linear layers."""
