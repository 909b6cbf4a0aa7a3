"""Installing and removing wrappers: ``Patcher`` (the op table's wrappers, in every namespace that
holds an original, restored by identity) and the primitives it shares with the integrations
(``hooks.Patches``, ``hooks.when_imported``). Imports ``record``; never ``integrations`` or above."""
