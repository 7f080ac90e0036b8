"""The main job: the embedded pair on HumanEval prompts, AR vs DFlash vs DDTree."""
