//! Tests of the parse, check and expand phases as library code, through `proc_macro2`.

use proptest::prelude::*;
use syn::DeriveInput;

use crate::expand::{derive, try_expand};

/// Pieces of attribute arguments: grammar words, mistakes and stray tokens.
const ATTR_PIECES: &[&str] = &[
    "fp32",
    "fp16",
    "bf16",
    "half",
    "f32",
    "f16",
    "float32",
    "float16",
    "bfloat16",
    "fp61",
    "skip",
    "default",
    "default = bf16",
    "default = fp61",
    "default = \"bf16\"",
    "default = 3",
    "precision = fp16",
    "a::b",
    "fp16(x)",
    "skip = 1",
    "skip(x)",
    "=",
    ",",
    "::",
    "1",
    "\"s\"",
    "(fp16)",
    "[]",
    "default =",
    "Self",
    "r#type",
];

/// Field types: layers, containers, generics, lifetimes, and types that are no module.
const TYPES: &[&str] = &[
    "Linear",
    "amp::nn::LayerNorm",
    "Vec<Mlp>",
    "Option<Box<M>>",
    "[Linear; 4]",
    "M",
    "&'a Linear",
    "usize",
    "(Linear, M)",
    "<M as Tr>::Out",
    "fn(M) -> Linear",
    "Box<dyn Tr + Send>",
];

const GENERICS: &[&str] = &["", "<M>", "<'a, M: Clone>", "<M, const N: usize>", "<M> where M: Copy"];

fn attr_args() -> impl Strategy<Value = String> {
    prop::collection::vec(prop::sample::select(ATTR_PIECES), 0..4).prop_map(|pieces| pieces.join(" , "))
}

fn attrs() -> impl Strategy<Value = String> {
    prop::collection::vec((attr_args(), any::<bool>()), 0..3).prop_map(|attrs| {
        attrs
            .into_iter()
            .map(
                |(args, parens)| {
                    if parens {
                        format!("#[amp({args})] ")
                    } else {
                        format!("#[amp = {args:?}] ")
                    }
                },
            )
            .collect()
    })
}

/// A struct (named, tuple or unit), enum or union with random attributes.
fn any_item() -> impl Strategy<Value = String> {
    let fields = prop::collection::vec((attrs(), prop::sample::select(TYPES)), 0..5);
    (attrs(), prop::sample::select(GENERICS), fields, 0..5u8).prop_map(
        |(item_attrs, generics, fields, kind)| {
            let named: Vec<String> =
                fields.iter().enumerate().map(|(i, (attrs, ty))| format!("{attrs} f{i}: {ty}")).collect();
            let unnamed: Vec<String> = fields.iter().map(|(attrs, ty)| format!("{attrs} {ty}")).collect();
            let (generics, where_clause) = match generics.split_once(" where ") {
                Some((generics, bounds)) => (generics, format!("where {bounds}")),
                None => (generics, String::new()),
            };
            let body = match kind {
                0 => format!("struct S{generics} {where_clause} {{ {} }}", named.join(", ")),
                1 => format!("struct S{generics} ({}) {where_clause};", unnamed.join(", ")),
                2 => format!("struct S{generics} {where_clause};"),
                3 => format!("enum S{generics} {where_clause} {{ A({}) }}", unnamed.join(", ")),
                _ => format!("union S{generics} {where_clause} {{ {} }}", named.join(", ")),
            };
            format!("{item_attrs}{body}")
        },
    )
}

/// A valid struct: known precisions, at most one attribute per field, types that may be modules.
fn valid_struct() -> impl Strategy<Value = String> {
    let precision = prop::sample::select(&["fp32", "fp16", "bf16", "half", "f16", "bfloat16", "float32"][..]);
    let field_attr = prop_oneof![
        Just(String::new()),
        Just("#[amp(skip)]".to_string()),
        precision.clone().prop_map(|p| format!("#[amp({p})]")),
    ];
    let ty =
        prop::sample::select(&["Linear", "amp::nn::LayerNorm", "Vec<Mlp>", "Option<Box<M>>", "[M; 2]"][..]);
    let fields = prop::collection::vec((field_attr, ty), 0..6);
    let default = prop::option::of(precision);
    (default, fields, any::<bool>()).prop_map(|(default, fields, tuple)| {
        let default = default.map(|p| format!("#[amp(default = {p})]")).unwrap_or_default();
        if tuple {
            let fields: Vec<String> = fields.iter().map(|(attr, ty)| format!("{attr} {ty}")).collect();
            format!("{default} struct S<M>({}) where M: Clone;", fields.join(", "))
        } else {
            let fields: Vec<String> =
                fields.iter().enumerate().map(|(i, (attr, ty))| format!("{attr} f{i}: {ty}")).collect();
            format!("{default} struct S<M> where M: Clone {{ {} }}", fields.join(", "))
        }
    })
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 1024, ..ProptestConfig::default() })]

    #[test]
    fn any_input_gives_ok_or_errors_and_parseable_output(source in any_item()) {
        // Sources that are no Rust item never reach a derive; only parsed items are of interest.
        if let Ok(node) = syn::parse_str::<DeriveInput>(&source) {
            let checked = try_expand(&node);
            let output = derive(&node);
            prop_assert!(syn::parse2::<syn::File>(output).is_ok(), "unparseable output for {}", source);
            if let Err(error) = checked {
                prop_assert!(error.into_iter().count() >= 1);
            }
        }
    }

    #[test]
    fn valid_structs_expand_to_parseable_code(source in valid_struct()) {
        let node = syn::parse_str::<DeriveInput>(&source);
        prop_assert!(node.is_ok(), "test generator wrote invalid Rust: {}", source);
        if let Ok(node) = node {
            match try_expand(&node) {
                Ok(output) => prop_assert!(syn::parse2::<syn::File>(output).is_ok(), "{}", source),
                Err(error) => return Err(TestCaseError::fail(format!("{source} rejected: {error}"))),
            }
        }
    }
}

fn errors_of(source: &str) -> Vec<String> {
    match syn::parse_str::<DeriveInput>(source) {
        Ok(node) => match try_expand(&node) {
            Ok(_) => Vec::new(),
            Err(error) => error.into_iter().map(|error| error.to_string()).collect(),
        },
        Err(error) => vec![format!("test source does not parse: {error}")],
    }
}

#[test]
fn every_bad_attribute_of_a_struct_is_reported_in_one_pass() {
    let errors = errors_of(
        "#[amp(fp16)] struct S { #[amp(fp61)] a: Linear, #[amp(fp16, fp32)] b: Linear, \
         #[amp(skip, bf16)] c: f32, #[amp(default = bf16)] d: Linear }",
    );
    assert_eq!(errors.len(), 5, "{errors:#?}");
    let expected = [
        "#[amp(default = fp16)]",
        "unknown precision `fp61`",
        "conflicting precisions",
        "contradict",
        "belongs on the struct",
    ];
    for (error, part) in errors.iter().zip(expected) {
        assert!(error.contains(part), "errors out of source order, expected {part} in {error}");
    }
}

#[test]
fn a_repeat_in_a_second_attribute_is_a_duplicate() {
    let errors = errors_of("struct S { #[amp(fp16)] #[amp(f16)] a: Linear }");
    assert_eq!(errors.len(), 1, "{errors:#?}");
    assert!(errors[0].contains("duplicate precision"), "{errors:#?}");
}

#[test]
fn enums_and_unions_are_refused_with_what_to_do() {
    for source in ["enum E { A(Linear) }", "union U { a: u32 }"] {
        let errors = errors_of(source);
        assert_eq!(errors.len(), 1, "{errors:#?}");
        assert!(errors[0].starts_with("`#[derive(AmpModule)]` supports structs"), "{errors:#?}");
    }
}

#[test]
fn unit_and_empty_structs_are_modules() {
    assert_eq!(errors_of("struct Unit;"), Vec::<String>::new());
    assert_eq!(errors_of("#[amp(default = bf16)] struct Empty {}"), Vec::<String>::new());
    assert_eq!(errors_of("struct Config { #[amp(skip)] rate: f32 }"), Vec::<String>::new());
}

#[test]
fn field_types_are_written_without_token_spaces() {
    let cases = [
        ("amp::nn::LayerNorm", "amp::nn::LayerNorm"),
        ("Vec<Option<Box<M>>>", "Vec<Option<Box<M>>>"),
        ("[Linear; 4]", "[Linear; 4]"),
        ("&'a mut Box<dyn Tr + Send>", "&'a mut Box<dyn Tr + Send>"),
        ("fn(M, u8) -> Linear", "fn(M, u8) -> Linear"),
        ("<M as Tr>::Out", "<M as Tr>::Out"),
        ("Box<dyn Iterator<Item = M>>", "Box<dyn Iterator<Item = M>>"),
    ];
    for (written, expected) in cases {
        let node = syn::parse_str::<DeriveInput>(&format!("struct S {{ f: {written} }}"));
        let text = match &node {
            Ok(node) => {
                let mut cx = crate::check::Ctxt::new();
                let text =
                    crate::ast::Input::from_syn(&mut cx, node).map(|input| input.fields[0].type_text());
                assert!(cx.finish().is_ok());
                text.map_err(|error| error.to_string())
            }
            Err(error) => Err(error.to_string()),
        };
        assert_eq!(text.as_deref(), Ok(expected));
    }
}

#[test]
fn a_module_that_holds_itself_is_refused_however_it_names_itself_in_this_module() {
    for field in ["Vec<Tree>", "Option<Box<Self>>", "Vec<self::Tree>", "[Box<self::Tree>; 2]"] {
        let errors = errors_of(&format!("struct Tree {{ fc: Linear, children: {field} }}"));
        assert_eq!(errors.len(), 1, "{field}: {errors:#?}");
        assert!(errors[0].contains("holds a `Tree` inside a `Tree`"), "{field}: {errors:#?}");
    }
    // Another module's `Tree`, or the crate root's (which may be another one than this module's).
    for field in ["Vec<other::Tree>", "Vec<crate::Tree>", "Vec<self::inner::Tree>", "Vec<super::Tree>"] {
        let errors = errors_of(&format!("struct Tree {{ fc: Linear, children: {field} }}"));
        assert_eq!(errors, Vec::<String>::new(), "{field}");
    }
}

#[test]
fn a_precision_in_capitals_or_with_a_dash_is_quoted_as_written_with_the_spelling_to_use() {
    for (field, quoted, fix) in [
        ("#[amp(FP16)] a: Linear", "`FP16` in `#[amp(FP16)]`", "`#[amp(fp16)]`"),
        ("#[amp(Bf16)] a: Linear", "`Bf16` in `#[amp(Bf16)]`", "`#[amp(bf16)]`"),
        ("#[amp(fp-16)] a: Linear", "`fp-16` in `#[amp(fp-16)]`", "`#[amp(fp16)]`"),
        ("#[amp(bf-16, skip)] a: Linear", "`bf-16` in `#[amp(bf-16)]`", "`#[amp(bf16)]`"),
    ] {
        let errors = errors_of(&format!("struct S {{ {field} }}"));
        assert_eq!(errors.len(), 1, "{field}: {errors:#?}");
        assert!(errors[0].contains(quoted) && errors[0].contains(fix), "{field}: {errors:#?}");
    }
    let errors = errors_of("#[amp(default = BF16)] struct S { a: Linear }");
    assert!(errors.len() == 1 && errors[0].contains("`#[amp(default = bf16)]`"), "{errors:#?}");
    let errors = errors_of("struct S { #[amp(fp61)] a: Linear }");
    assert!(errors.len() == 1 && errors[0].contains("expected one of: fp32"), "{errors:#?}");
}

#[test]
fn a_packed_struct_is_refused_at_its_packed_word() {
    for repr in ["#[repr(packed)]", "#[repr(C, packed(2))]", "#[repr(align(8))] #[repr(packed)]"] {
        let errors = errors_of(&format!("{repr} struct S {{ fc: Linear }}"));
        assert_eq!(errors.len(), 1, "{repr}: {errors:#?}");
        assert!(errors[0].contains("does not support `#[repr(packed)]`"), "{repr}: {errors:#?}");
    }
    for repr in ["#[repr(C)]", "#[repr(C, align(16))]", "#[repr(transparent)]"] {
        assert_eq!(errors_of(&format!("{repr} struct S {{ fc: Linear }}")), Vec::<String>::new(), "{repr}");
    }
}

#[test]
fn the_request_parameter_is_renamed_past_the_structs_own_parameters() {
    let names = |generics: &str| match syn::parse_str::<DeriveInput>(&format!(
        "struct S{generics} {{ inner: Linear }}"
    )) {
        Ok(node) => crate::expand::request_param(&node.generics).to_string(),
        Err(error) => format!("test source {generics} does not parse: {error}"),
    };
    assert_eq!(names(""), "__AmpR");
    assert_eq!(names("<'__AmpR, M>"), "__AmpR");
    assert_eq!(names("<__AmpR>"), "__AmpR_");
    assert_eq!(names("<__AmpR, const __AmpR_: usize>"), "__AmpR__");
}
