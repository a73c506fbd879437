# projects/ holds users' scripts that the tests launch, not test modules: --doctest-modules must not import them.
collect_ignore = ["projects"]
