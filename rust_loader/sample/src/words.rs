//! The generator's word lists: data files in `rust_loader/sample/words/`, compiled in with `include_str!`.
//!
//! One entry per line; `.tsv` files hold tab-separated fields (an ingredient and its measure, a dish and how it
//! is cooked); lines starting with `#` say what a list is. Lists drawn with a Zipf weight are in frequency
//! order: earlier lines are drawn more often. Editing a file changes what `trainer data sample` writes for a
//! seed; `cargo test` reads every file, so a malformed line fails the build's tests, never a user's run.

use std::sync::OnceLock;

use crate::{Kind, Method};

/// Every list, parsed once.
pub(crate) struct Words {
    pub savory: Vec<(&'static str, Kind)>,
    pub sweet: Vec<(&'static str, Kind)>,
    /// (ingredient as written, the word titles use, measure).
    pub savory_mains: Vec<(&'static str, &'static str, Kind)>,
    pub sweet_mains: Vec<(&'static str, &'static str, Kind)>,
    pub savory_dishes: Vec<(&'static str, Method)>,
    pub sweet_dishes: Vec<(&'static str, Method)>,
    pub title_adj: Vec<&'static str>,
    pub savory_flavor: Vec<&'static str>,
    pub sweet_flavor: Vec<&'static str>,
    pub bowl: Vec<&'static str>,
    pub pan: Vec<&'static str>,
    pub dish: Vec<&'static str>,
    pub heat: Vec<&'static str>,
    pub savory_done: Vec<&'static str>,
    pub sweet_done: Vec<&'static str>,
    pub sweet_stove_done: Vec<&'static str>,
    pub mix_adverb: Vec<&'static str>,
    pub serve_savory: Vec<&'static str>,
    pub serve_sweet: Vec<&'static str>,
    pub garnish_savory: Vec<&'static str>,
    pub garnish_sweet: Vec<&'static str>,
    pub sizes: Vec<&'static str>,
    pub person: Vec<&'static str>,
    pub desc_open: Vec<&'static str>,
    pub desc_close: Vec<&'static str>,
    pub foodcom_tags: Vec<&'static str>,
    pub tail_nouns: Vec<&'static str>,
}

/// The word lists (parsed at the first call).
pub(crate) fn words() -> &'static Words {
    static WORDS: OnceLock<Words> = OnceLock::new();
    WORDS.get_or_init(Words::parse)
}

macro_rules! file {
    ($name:literal) => {
        ($name, include_str!(concat!("../words/", $name)))
    };
}

type Source = (&'static str, &'static str);

/// The entries of a list file: its lines without blank and `#` lines, each split at tabs into `N` fields.
fn rows<const N: usize>((name, text): Source) -> Vec<[&'static str; N]> {
    let rows: Vec<[&'static str; N]> = text
        .lines()
        .enumerate()
        .filter(|(_, line)| !line.trim().is_empty() && !line.starts_with('#'))
        .map(|(i, line)| {
            let fields: Vec<&'static str> = line.split('\t').collect();
            fields.try_into().unwrap_or_else(|f: Vec<_>| {
                panic!(
                    "words/{name}:{}: {} tab-separated fields, expected {N}",
                    i + 1,
                    f.len()
                )
            })
        })
        .collect();
    assert!(!rows.is_empty(), "words/{name} has no entries");
    rows
}

fn list(source: Source) -> Vec<&'static str> {
    rows::<1>(source).into_iter().map(|[word]| word).collect()
}

fn kind(name: &str, field: &str) -> Kind {
    match field {
        "Dry" => Kind::Dry,
        "Liquid" => Kind::Liquid,
        "Spice" => Kind::Spice,
        "Count" => Kind::Count,
        "Meat" => Kind::Meat,
        "Can" => Kind::Can,
        "Fat" => Kind::Fat,
        "Cheese" => Kind::Cheese,
        "Herb" => Kind::Herb,
        "Clove" => Kind::Clove,
        "Whole" => Kind::Whole,
        other => panic!("words/{name}: unknown measure {other:?}"),
    }
}

fn method(name: &str, field: &str) -> Method {
    match field {
        "Bake" => Method::Bake,
        "Stove" => Method::Stove,
        "Simmer" => Method::Simmer,
        "Cold" => Method::Cold,
        "Grill" => Method::Grill,
        "SlowCooker" => Method::SlowCooker,
        "Fry" => Method::Fry,
        other => panic!("words/{name}: unknown method {other:?}"),
    }
}

fn measured(source: Source) -> Vec<(&'static str, Kind)> {
    rows::<2>(source)
        .into_iter()
        .map(|[w, k]| (w, kind(source.0, k)))
        .collect()
}

fn mains(source: Source) -> Vec<(&'static str, &'static str, Kind)> {
    rows::<3>(source)
        .into_iter()
        .map(|[w, t, k]| (w, t, kind(source.0, k)))
        .collect()
}

fn dishes(source: Source) -> Vec<(&'static str, Method)> {
    rows::<2>(source)
        .into_iter()
        .map(|[d, m]| (d, method(source.0, m)))
        .collect()
}

impl Words {
    fn parse() -> Self {
        Words {
            savory: measured(file!("savory.tsv")),
            sweet: measured(file!("sweet.tsv")),
            savory_mains: mains(file!("savory_mains.tsv")),
            sweet_mains: mains(file!("sweet_mains.tsv")),
            savory_dishes: dishes(file!("savory_dishes.tsv")),
            sweet_dishes: dishes(file!("sweet_dishes.tsv")),
            title_adj: list(file!("title_adj.txt")),
            savory_flavor: list(file!("savory_flavor.txt")),
            sweet_flavor: list(file!("sweet_flavor.txt")),
            bowl: list(file!("bowl.txt")),
            pan: list(file!("pan.txt")),
            dish: list(file!("dish.txt")),
            heat: list(file!("heat.txt")),
            savory_done: list(file!("savory_done.txt")),
            sweet_done: list(file!("sweet_done.txt")),
            sweet_stove_done: list(file!("sweet_stove_done.txt")),
            mix_adverb: list(file!("mix_adverb.txt")),
            serve_savory: list(file!("serve_savory.txt")),
            serve_sweet: list(file!("serve_sweet.txt")),
            garnish_savory: list(file!("garnish_savory.txt")),
            garnish_sweet: list(file!("garnish_sweet.txt")),
            sizes: list(file!("sizes.txt")),
            person: list(file!("person.txt")),
            desc_open: list(file!("desc_open.txt")),
            desc_close: list(file!("desc_close.txt")),
            foodcom_tags: list(file!("foodcom_tags.txt")),
            tail_nouns: list(file!("tail_nouns.txt")),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_list_parses_with_entries_and_no_stray_whitespace() {
        let w = Words::parse();
        assert_eq!(w.savory[0], ("salt", Kind::Spice));
        assert_eq!(
            w.savory_mains[0],
            ("boneless skinless chicken breasts", "Chicken", Kind::Meat)
        );
        assert_eq!(w.sweet_dishes.len(), 30);
        let all = [
            &w.title_adj,
            &w.savory_flavor,
            &w.sweet_flavor,
            &w.bowl,
            &w.pan,
            &w.dish,
            &w.heat,
            &w.savory_done,
            &w.sweet_done,
            &w.sweet_stove_done,
            &w.mix_adverb,
            &w.serve_savory,
            &w.serve_sweet,
            &w.garnish_savory,
            &w.garnish_sweet,
            &w.sizes,
            &w.person,
            &w.desc_open,
            &w.desc_close,
            &w.foodcom_tags,
            &w.tail_nouns,
        ];
        for list in all {
            assert!(
                list.iter().all(|e| !e.is_empty() && e.trim() == *e),
                "{list:?}"
            );
        }
    }

    #[test]
    #[should_panic(expected = "words/bad.tsv:2: 1 tab-separated fields, expected 2")]
    fn a_malformed_line_names_its_file_and_line() {
        rows::<2>(("bad.tsv", "# a list\nsalt\n"));
    }
}
