//! Rendering a recipe into the source and target texts.
//!
//! Templates use `{title}`, `{ingredients}`, `{directions}` and `{ner}`; `{{` and `}}` write literal braces.
//! An unknown placeholder is an error when the renderer is built. List rules (chosen because T5's tokenizer
//! turns newlines into plain spaces, so newlines cannot separate anything):
//! - ingredients: items trimmed and joined with `"; "`;
//! - directions: steps trimmed and numbered, `"1. Mix. 2. Bake."` (joined with a single space);
//! - ner: items joined with `", "`;
//! - a field given as one string (JSONL) is used as is, trimmed.
//!
//! Presets: `ingredients-to-recipe` (default) renders source `"Write a recipe with these ingredients:
//! {ingredients}"` and target `"title: {title} | ingredients: {ingredients} | directions: {directions}"`;
//! `title-to-recipe` renders source `"Write a recipe for: {title}"` with the same target. Pre-rendered JSONL pairs
//! (`source`/`target`, `input`/`output`) are used verbatim. A recipe whose field used by a template is empty is
//! skipped as `empty_<field>`.
use crate::error::{LoaderError, Result};
use crate::formats::{Field, Parsed, Recipe, Skip};

pub const TARGET_TEMPLATE: &str =
    "title: {title} | ingredients: {ingredients} | directions: {directions}";

/// `(source, target)` templates of a preset task.
pub fn preset(task: &str) -> Option<(&'static str, &'static str)> {
    match task {
        "ingredients-to-recipe" => Some((
            "Write a recipe with these ingredients: {ingredients}",
            TARGET_TEMPLATE,
        )),
        "title-to-recipe" => Some(("Write a recipe for: {title}", TARGET_TEMPLATE)),
        _ => None,
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Name {
    Title,
    Ingredients,
    Directions,
    Ner,
}

#[derive(Clone, Debug, PartialEq)]
enum Part {
    Lit(String),
    Field(Name),
}

/// A parsed template.
#[derive(Clone, Debug, PartialEq)]
pub struct Template {
    parts: Vec<Part>,
    pub text: String,
}

impl Template {
    pub fn parse(text: &str) -> Result<Template> {
        let bad = |m: String| LoaderError::Config(format!("template {text:?}: {m}"));
        let mut parts = Vec::new();
        let mut lit = String::new();
        let mut chars = text.chars().peekable();
        while let Some(c) = chars.next() {
            match c {
                '{' if chars.peek() == Some(&'{') => {
                    chars.next();
                    lit.push('{');
                }
                '}' if chars.peek() == Some(&'}') => {
                    chars.next();
                    lit.push('}');
                }
                '{' => {
                    let mut name = String::new();
                    loop {
                        match chars.next() {
                            Some('}') => break,
                            Some(c) => name.push(c),
                            None => return Err(bad("unclosed `{`".into())),
                        }
                    }
                    let field = match name.as_str() {
                        "title" => Name::Title,
                        "ingredients" => Name::Ingredients,
                        "directions" => Name::Directions,
                        "ner" | "NER" => Name::Ner,
                        other => {
                            return Err(bad(format!(
                                "unknown placeholder {{{other}}} (known: {{title}}, {{ingredients}}, {{directions}}, {{ner}})"
                            )))
                        }
                    };
                    if !lit.is_empty() {
                        parts.push(Part::Lit(std::mem::take(&mut lit)));
                    }
                    parts.push(Part::Field(field));
                }
                '}' => return Err(bad("single `}` (write `}}` for a literal brace)".into())),
                c => lit.push(c),
            }
        }
        if !lit.is_empty() {
            parts.push(Part::Lit(lit));
        }
        Ok(Template {
            parts,
            text: text.to_string(),
        })
    }

    fn uses(&self, n: Name) -> bool {
        self.parts.contains(&Part::Field(n))
    }
}

fn join_list(f: &Field, sep: &str) -> String {
    match f {
        Field::Text(s) => s.trim().to_string(),
        Field::List(v) => v
            .iter()
            .map(|s| s.trim())
            .filter(|s| !s.is_empty())
            .collect::<Vec<_>>()
            .join(sep),
    }
}

fn number_steps(f: &Field) -> String {
    match f {
        Field::Text(s) => s.trim().to_string(),
        Field::List(v) => {
            let steps: Vec<&str> = v
                .iter()
                .map(|s| s.trim())
                .filter(|s| !s.is_empty())
                .collect();
            let mut out = String::new();
            for (i, s) in steps.iter().enumerate() {
                if i > 0 {
                    out.push(' ');
                }
                out.push_str(&format!("{}. {}", i + 1, s));
            }
            out
        }
    }
}

/// The first field that a template uses (`uses`) and the record leaves empty, as a skip.
fn check_fields(r: &Recipe, uses: impl Fn(Name) -> bool) -> std::result::Result<(), Skip> {
    if uses(Name::Title) && r.title.trim().is_empty() {
        return Err(Skip::new("empty_title", "empty title"));
    }
    if uses(Name::Ingredients) && r.ingredients.is_empty() {
        return Err(Skip::new("empty_ingredients", "empty ingredients"));
    }
    if uses(Name::Directions) && r.directions.is_empty() {
        return Err(Skip::new("empty_directions", "empty directions"));
    }
    Ok(())
}

/// Source and target templates, validated.
#[derive(Clone, Debug)]
pub struct Renderer {
    pub source: Template,
    pub target: Template,
}

impl Renderer {
    /// Builds from a preset task, each template optionally overridden.
    pub fn new(task: &str, source: Option<&str>, target: Option<&str>) -> Result<Renderer> {
        let (ps, pt) = preset(task).ok_or_else(|| {
            LoaderError::Config(format!(
                "unknown task {task:?} (known: ingredients-to-recipe, title-to-recipe)"
            ))
        })?;
        Ok(Renderer {
            source: Template::parse(source.unwrap_or(ps))?,
            target: Template::parse(target.unwrap_or(pt))?,
        })
    }

    fn render_one(t: &Template, title: &str, ingr: &str, dirs: &str, ner: &str) -> String {
        let mut out = String::new();
        for p in &t.parts {
            match p {
                Part::Lit(s) => out.push_str(s),
                Part::Field(Name::Title) => out.push_str(title),
                Part::Field(Name::Ingredients) => out.push_str(ingr),
                Part::Field(Name::Directions) => out.push_str(dirs),
                Part::Field(Name::Ner) => out.push_str(ner),
            }
        }
        out
    }

    /// Renders `(source, target)`, or says why the record is unusable.
    pub fn render(&self, p: &Parsed) -> std::result::Result<(String, String), Skip> {
        let r = match p {
            Parsed::Pair { source, target } => return Ok((source.clone(), target.clone())),
            Parsed::Recipe(r) => r,
        };
        check_fields(r, |n| self.source.uses(n) || self.target.uses(n))?;
        let title = r.title.trim();
        let ingr = join_list(&r.ingredients, "; ");
        let dirs = number_steps(&r.directions);
        let ner = join_list(&r.ner, ", ");
        Ok((
            Self::render_one(&self.source, title, &ingr, &dirs, &ner),
            Self::render_one(&self.target, title, &ingr, &dirs, &ner),
        ))
    }

    /// Renders the source (the prompt) alone, needing only the fields the source template uses.
    pub fn render_source(&self, p: &Parsed) -> std::result::Result<String, Skip> {
        match p {
            Parsed::Pair { source, .. } => Ok(source.clone()),
            Parsed::Recipe(r) => Self::render_side(&self.source, r),
        }
    }

    /// Renders the target (the reference) alone, needing only the fields the target template uses.
    pub fn render_target(&self, p: &Parsed) -> std::result::Result<String, Skip> {
        match p {
            Parsed::Pair { target, .. } => Ok(target.clone()),
            Parsed::Recipe(r) => Self::render_side(&self.target, r),
        }
    }

    fn render_side(t: &Template, r: &Recipe) -> std::result::Result<String, Skip> {
        check_fields(r, |n| t.uses(n))?;
        let ingr = join_list(&r.ingredients, "; ");
        let dirs = number_steps(&r.directions);
        let ner = join_list(&r.ner, ", ");
        Ok(Self::render_one(t, r.title.trim(), &ingr, &dirs, &ner))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn presets_and_rules() {
        let r = Renderer::new("ingredients-to-recipe", None, None).unwrap();
        let rec = Parsed::Recipe(Recipe {
            title: " Pie ".into(),
            ingredients: Field::List(vec!["1 egg".into(), " 2 cups flour".into()]),
            directions: Field::List(vec!["Mix.".into(), "Bake.".into()]),
            ner: Field::List(vec!["egg".into(), "flour".into()]),
        });
        let (s, t) = r.render(&rec).unwrap();
        assert_eq!(
            s,
            "Write a recipe with these ingredients: 1 egg; 2 cups flour"
        );
        assert_eq!(
            t,
            "title: Pie | ingredients: 1 egg; 2 cups flour | directions: 1. Mix. 2. Bake."
        );
        let r = Renderer::new("title-to-recipe", None, Some("{{x}} {ner}")).unwrap();
        let (s, t) = r.render(&rec).unwrap();
        assert_eq!(s, "Write a recipe for: Pie");
        assert_eq!(t, "{x} egg, flour");
    }

    #[test]
    fn unknown_placeholder_is_an_error() {
        let e = Renderer::new("ingredients-to-recipe", Some("{titel}"), None).unwrap_err();
        assert!(e.to_string().contains("{titel}"), "{e}");
        assert!(Renderer::new("nope", None, None).is_err());
        assert!(Template::parse("{title").is_err());
    }

    #[test]
    fn one_side_needs_only_its_own_fields() {
        let r = Renderer::new("ingredients-to-recipe", None, None).unwrap();
        let prompt_only = Parsed::Recipe(Recipe {
            title: String::new(),
            ingredients: Field::List(vec!["2 eggs".into(), "1 cup flour".into()]),
            directions: Field::List(vec![]),
            ner: Field::List(vec![]),
        });
        assert_eq!(
            r.render_source(&prompt_only).unwrap(),
            "Write a recipe with these ingredients: 2 eggs; 1 cup flour"
        );
        assert_eq!(
            r.render_target(&prompt_only).unwrap_err().reason,
            "empty_title"
        );
        assert_eq!(r.render(&prompt_only).unwrap_err().reason, "empty_title");
        let full = Parsed::Recipe(Recipe {
            title: "Pie".into(),
            directions: Field::List(vec!["Mix.".into()]),
            ..match prompt_only {
                Parsed::Recipe(r) => r,
                _ => unreachable!(),
            }
        });
        let (s, t) = r.render(&full).unwrap();
        assert_eq!(r.render_source(&full).unwrap(), s);
        assert_eq!(r.render_target(&full).unwrap(), t);
    }

    #[test]
    fn empty_fields_are_skipped() {
        let r = Renderer::new("ingredients-to-recipe", None, None).unwrap();
        let rec = Parsed::Recipe(Recipe {
            title: "T".into(),
            ingredients: Field::List(vec![]),
            directions: Field::Text("x".into()),
            ner: Field::List(vec![]),
        });
        assert_eq!(r.render(&rec).unwrap_err().reason, "empty_ingredients");
    }
}
