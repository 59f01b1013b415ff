//! Measurement, not a test: per-word id cache against one tokenizer call per text, on
//! generated recipes rendered like the loader renders them, with the ids of both compared.
//!
//! `cargo bench -p recipe_sample --bench tokenize`
//! (`TOKENIZER=/path/to/tokenizer.json` and `N=...` to change the defaults: the test tokenizer, 20000 recipes).
use std::path::{Path, PathBuf};
use std::time::Instant;

use rayon::prelude::*;
use recipe_core::formats::{Field, Parsed, Recipe};
use recipe_core::render::Renderer;
use recipe_core::tokenize::Tok;
use recipe_sample::RecipeGen;

fn main() {
    let tokenizer = std::env::var_os("TOKENIZER")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            Path::new(env!("CARGO_MANIFEST_DIR")).join("../core/tests/data/tokenizer.json")
        });
    let n: usize = std::env::var("N").map_or(20_000, |v| v.parse().unwrap());
    let renderer = Renderer::new("ingredients-to-recipe", None, None).unwrap();
    let mut g = RecipeGen::new(0);
    let texts: Vec<(String, String)> = (0..n)
        .map(|_| {
            let r = g.next_recipe();
            renderer
                .render(&Parsed::Recipe(Recipe {
                    title: r.title.clone(),
                    ingredients: Field::List(r.ingredients.clone()),
                    directions: Field::List(r.directions.clone()),
                    ner: Field::List(r.ner.clone()),
                }))
                .unwrap()
        })
        .collect();
    let per_text = Tok::load_with(&tokenizer, 512, 512, false).unwrap();
    let per_word = Tok::load_with(&tokenizer, 512, 512, true).unwrap();
    assert!(
        per_word.per_word(),
        "this tokenizer is not eligible for the per-word path"
    );
    let run = |tok: &Tok, threads: usize| {
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .build()
            .unwrap();
        let t = Instant::now();
        let ids: Vec<_> = pool.install(|| {
            texts
                .par_iter()
                .map(|(s, t)| tok.encode(s, t).unwrap())
                .collect()
        });
        (ids, n as f64 / t.elapsed().as_secs_f64())
    };
    for threads in [1, 2] {
        let (a, text_rate) = run(&per_text, threads);
        let (b, word_rate) = run(&per_word, threads);
        assert!(a == b, "per-word ids differ from per-text ids");
        let tokens: usize = a.iter().map(|(s, t)| s.len() + t.len()).sum();
        println!(
            "{n} recipes ({:.0} tokens each), {threads} thread(s): per text {text_rate:.0} recipes/s, \
             per word {word_rate:.0} recipes/s ({:.2}x), ids identical",
            tokens as f64 / n as f64,
            word_rate / text_rate
        );
    }
}
