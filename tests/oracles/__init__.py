"""Reference implementations the tests compare production code against (the loops and paths it
replaced, the defects' WHERE table, the recorded evaluations the detection tests judge). Tests
import them from here; ``benchmarks/`` may import them too, never the other way round."""
