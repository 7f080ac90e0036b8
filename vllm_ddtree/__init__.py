"""vLLM DDTree plugin."""
def register():
    pass
