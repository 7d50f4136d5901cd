"""steptune.pipeline: OctoPipe, pipeline simulator, bubble-aware partition/placement/schedule tuner,
executor. Not built yet (issues #5, #6).
"""

__all__: list[str] = []
