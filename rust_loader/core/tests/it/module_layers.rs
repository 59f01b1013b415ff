//! The crate's modules form layers: no module uses, directly or through others, a module that uses it back.
//! A cycle (as `cancel` <-> `error` and `index` <-> `tokenize` once were) fails here, naming the modules.
use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

/// Module -> the modules its code names as `crate::<module>` (tests inside a module count too: they compile
/// with it; comments do not, a doc link is no dependency).
fn uses() -> BTreeMap<String, BTreeSet<String>> {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut out = BTreeMap::new();
    for entry in std::fs::read_dir(&src).unwrap() {
        let path = entry.unwrap().path();
        let name = path.file_stem().unwrap().to_string_lossy().into_owned();
        if name == "lib" {
            continue;
        }
        let text: String = std::fs::read_to_string(&path)
            .unwrap()
            .lines()
            .filter(|l| !l.trim_start().starts_with("//"))
            .collect::<Vec<_>>()
            .join("\n");
        let mut used = BTreeSet::new();
        for (i, _) in text.match_indices("crate::") {
            let rest = &text[i + "crate::".len()..];
            let module: String = rest
                .chars()
                .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
                .collect();
            if !module.is_empty() && module != name {
                used.insert(module);
            }
        }
        out.insert(name, used);
    }
    out
}

/// A cycle through `from`, as the modules on it, if there is one.
fn cycle(graph: &BTreeMap<String, BTreeSet<String>>, from: &str) -> Option<Vec<String>> {
    fn walk(
        graph: &BTreeMap<String, BTreeSet<String>>,
        at: &str,
        start: &str,
        path: &mut Vec<String>,
        seen: &mut BTreeSet<String>,
    ) -> bool {
        for next in graph.get(at).into_iter().flatten() {
            if next == start {
                return true;
            }
            if seen.insert(next.clone()) {
                path.push(next.clone());
                if walk(graph, next, start, path, seen) {
                    return true;
                }
                path.pop();
            }
        }
        false
    }
    let mut path = vec![from.to_string()];
    walk(graph, from, from, &mut path, &mut BTreeSet::new()).then_some(path)
}

#[test]
fn no_module_depends_on_itself_through_others() {
    let graph = uses();
    assert!(graph.len() > 10, "read the modules: {graph:?}");
    for module in graph.keys() {
        if let Some(path) = cycle(&graph, module) {
            panic!("import cycle: {} -> {module}", path.join(" -> "));
        }
    }
}

#[test]
fn the_sample_generator_is_not_part_of_the_loader() {
    let manifest =
        std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("Cargo.toml")).unwrap();
    assert!(
        !manifest.contains("recipe_sample"),
        "recipe_core must not depend on recipe_sample"
    );
}
