"""Will it fit? Memory footprints, the settings megatrain would choose and a step-time bound (``plan``)."""
