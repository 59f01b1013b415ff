//! Parquet and Arrow IPC files: records as rows of typed columns.
//!
//! A record is addressed by `(batch, row)` in an Arrow IPC file read in place: the file is memory-mapped and a
//! record batch is decoded (zero-copy: its arrays point into the map) the first time a record of it is read, then
//! kept for every later read. Arrow IPC comes as a file (`ARROW1` magic, Feather v2: its footer lists the
//! batches) or as a stream (what `datasets` writes: the batches are found by walking the messages once).
//!
//! Parquet pages are compressed and encoded, so a row cannot be read without decoding its pages; a Parquet file
//! (or an Arrow file whose buffers are compressed) is therefore decoded once, streaming, into an uncompressed
//! Arrow IPC file in the cache directory holding only the columns the records need, in the file's row order (see
//! [`convert`]); the copy is read as above. This is what the loader does for a `.gz` file, and what `datasets`
//! does for Parquet.
//!
//! The fields are the JSONL ones (`title`/`name`, `ingredients`, `directions`/`steps`, optional `NER`/`ner`, or
//! `source`/`target` pairs), under the names [`ColumnNames`] gives. A column holds strings (or binary UTF-8) or
//! lists of them: a list field read from a string column is parsed as a list when it spells one (a JSON array
//! or a Python list literal, as a RecipeNLG CSV re-saved through pandas holds), else used as text, as JSONL uses
//! a string.
use std::fs::File;
use std::path::Path;
use std::ptr::NonNull;
use std::sync::atomic::AtomicBool;
use std::sync::{Arc, OnceLock};

use arrow_array::cast::AsArray;
use arrow_array::{
    Array, BinaryArray, BinaryViewArray, LargeBinaryArray, LargeStringArray, RecordBatch,
    StringArray, StringViewArray,
};
use arrow_buffer::Buffer;
use arrow_ipc::reader::FileDecoder;
use arrow_ipc::writer::FileWriter;
use arrow_ipc::{Block, MessageHeader};
use arrow_schema::{DataType, Schema, SchemaRef};
use parquet::arrow::arrow_reader::{ParquetRecordBatchReader, ParquetRecordBatchReaderBuilder};
use parquet::arrow::ProjectionMask;

use crate::cancel;
use crate::error::{LoaderError, Result};
use crate::formats::{self, ColumnNames, Field, Format, Parsed, Recipe, Skip, MAX_RECORD_BYTES};

/// Rows per record batch of a converted copy: small enough that a batch decodes in microseconds, large enough
/// that the per-batch metadata is negligible.
pub const COPY_BATCH_ROWS: usize = 4096;

const FILE_MAGIC: &[u8; 6] = b"ARROW1";
const CONTINUATION: [u8; 4] = [0xff; 4];

/// An Arrow IPC file or stream, memory-mapped, its record batches decoded once each when first read.
pub struct ArrowTable {
    data: Buffer,
    decoder: FileDecoder,
    blocks: Vec<Block>,
    rows: Vec<u64>,
    batches: Vec<OnceLock<std::result::Result<RecordBatch, String>>>,
    schema: SchemaRef,
    compressed: bool,
}

impl ArrowTable {
    /// Maps and reads the layout of the Arrow IPC file or stream at `path` (`shown` names it in errors).
    pub fn open(path: &Path, shown: &str) -> Result<ArrowTable> {
        let file = File::open(path).map_err(|e| LoaderError::io(shown, "", &e))?;
        let len = file
            .metadata()
            .map_err(|e| LoaderError::io(shown, "", &e))?
            .len();
        if len == 0 {
            return Err(LoaderError::file(shown, "empty file"));
        }
        // SAFETY: the map lives as long as the buffers made from it (the Arc below owns it). A file truncated
        // under the map while it is read would fault: the loader maps its own cache copies, which are only ever
        // replaced by rename, and the user's Arrow files (docs/loader.md says not to rewrite them in place).
        let map = unsafe { memmap2::Mmap::map(&file) }
            .map_err(|e| LoaderError::io(shown, "cannot map", &e))?;
        let ptr = NonNull::new(map.as_ptr() as *mut u8).expect("a mapped file has an address");
        // SAFETY: `ptr` points to `map.len()` bytes that stay valid while `map` (owned by the buffer) lives.
        let data = unsafe { Buffer::from_custom_allocation(ptr, map.len(), Arc::new(map)) };
        let bad =
            |what: String| LoaderError::file(shown, format!("not a valid Arrow IPC file: {what}"));
        let layout = if data.starts_with(FILE_MAGIC) {
            file_layout(&data)
        } else {
            stream_layout(&data)
        }
        .map_err(bad)?;
        let mut decoder = FileDecoder::new(layout.schema.clone(), layout.version);
        for block in &layout.dictionaries {
            let message = message_at(&data, block).map_err(bad)?;
            if let Some(dictionary) = message.header_as_dictionary_batch() {
                if let Some(batch) = dictionary.data() {
                    check_buffers(&batch, block).map_err(bad)?;
                }
            }
            decoder
                .read_dictionary(block, &slice(&data, block))
                .map_err(|e| bad(e.to_string()))?;
        }
        let mut rows = Vec::with_capacity(layout.batches.len());
        let mut compressed = false;
        for block in &layout.batches {
            let message = message_at(&data, block).map_err(bad)?;
            let batch = message
                .header_as_record_batch()
                .ok_or_else(|| bad("a batch block that is not a record batch".into()))?;
            check_buffers(&batch, block).map_err(bad)?;
            compressed |= batch.compression().is_some();
            rows.push(u64::try_from(batch.length()).map_err(|_| bad("negative row count".into()))?);
        }
        Ok(ArrowTable {
            batches: (0..layout.batches.len()).map(|_| OnceLock::new()).collect(),
            blocks: layout.batches,
            rows,
            data,
            decoder,
            schema: layout.schema,
            compressed,
        })
    }

    pub fn schema(&self) -> &SchemaRef {
        &self.schema
    }

    pub fn num_batches(&self) -> usize {
        self.blocks.len()
    }

    /// Rows of batch `k`.
    pub fn batch_rows(&self, k: usize) -> u64 {
        self.rows[k]
    }

    /// Whether the batches' buffers are compressed (LZ4 or zstd, as `pyarrow.feather` writes by default):
    /// decoding such a batch copies it, so the loader reads a decoded copy instead.
    pub fn compressed(&self) -> bool {
        self.compressed
    }

    /// The bytes of the mapped file (for its content hash).
    pub fn bytes(&self) -> &[u8] {
        self.data.as_slice()
    }

    /// Batch `k`, decoded on first use.
    pub fn batch(&self, k: usize) -> std::result::Result<&RecordBatch, String> {
        self.batches[k]
            .get_or_init(|| {
                let block = &self.blocks[k];
                self.decoder
                    .read_record_batch(block, &slice(&self.data, block))
                    .map_err(|e| e.to_string())?
                    .ok_or_else(|| "an empty message where a record batch should be".to_string())
            })
            .as_ref()
            .map_err(Clone::clone)
    }
}

struct Layout {
    schema: SchemaRef,
    version: arrow_ipc::MetadataVersion,
    dictionaries: Vec<Block>,
    batches: Vec<Block>,
}

fn slice(data: &Buffer, block: &Block) -> Buffer {
    data.slice_with_length(
        block.offset() as usize,
        block.metaDataLength() as usize + block.bodyLength() as usize,
    )
}

fn message_at<'a>(
    data: &'a Buffer,
    block: &Block,
) -> std::result::Result<arrow_ipc::Message<'a>, String> {
    let start = block.offset() as usize;
    let meta = &data[start..start + block.metaDataLength() as usize];
    let fb = if meta.starts_with(&CONTINUATION) {
        &meta[8..]
    } else {
        &meta[4..]
    };
    arrow_ipc::root_as_message(fb).map_err(|e| format!("bad message: {e}"))
}

/// Checks that `block` lies inside `data`.
fn check_block(data: &Buffer, block: &Block) -> std::result::Result<(), String> {
    let (offset, meta, body) = (block.offset(), block.metaDataLength(), block.bodyLength());
    let end = (offset >= 0 && meta >= 8 && body >= 0)
        .then(|| (offset as u64).checked_add(meta as u64 + body as u64))
        .flatten();
    match end {
        Some(end) if end <= data.len() as u64 => Ok(()),
        _ => Err("a block outside the file (truncated?)".into()),
    }
}

/// Checks that every buffer of a record batch lies inside its message's body: arrow-ipc slices them without
/// a check of its own (a panic, not an error, on a damaged file).
fn check_buffers(batch: &arrow_ipc::RecordBatch, block: &Block) -> std::result::Result<(), String> {
    let body = block.bodyLength();
    for buffer in batch.buffers().iter().flatten() {
        let end = (buffer.offset() >= 0 && buffer.length() >= 0)
            .then(|| buffer.offset().checked_add(buffer.length()))
            .flatten();
        if end.is_none_or(|end| end > body) {
            return Err("a buffer outside its record batch (truncated or damaged?)".into());
        }
    }
    Ok(())
}

/// The layout of an IPC file, from its footer.
fn file_layout(data: &Buffer) -> std::result::Result<Layout, String> {
    if data.len() < 18 {
        return Err("too short".into());
    }
    let trailer = data.len() - 10;
    let footer_len =
        arrow_ipc::reader::read_footer_length(data[trailer..].try_into().expect("10 bytes"))
            .map_err(|e| format!("{e} (truncated?)"))?;
    if footer_len > trailer {
        return Err("footer longer than the file".into());
    }
    let footer = arrow_ipc::root_as_footer(&data[trailer - footer_len..trailer])
        .map_err(|e| format!("bad footer: {e}"))?;
    let schema = footer.schema().ok_or("no schema in the footer")?;
    let schema = arrow_ipc::convert::try_fb_to_schema(schema).map_err(|e| e.to_string())?;
    let dictionaries: Vec<Block> = footer.dictionaries().iter().flatten().copied().collect();
    let batches: Vec<Block> = footer.recordBatches().iter().flatten().copied().collect();
    for b in dictionaries.iter().chain(&batches) {
        check_block(data, b)?;
    }
    Ok(Layout {
        schema: Arc::new(schema),
        version: footer.version(),
        dictionaries,
        batches,
    })
}

/// The layout of an IPC stream: its messages walked once (schema, dictionaries, record batches).
fn stream_layout(data: &Buffer) -> std::result::Result<Layout, String> {
    let mut pos = 0usize;
    let (mut schema, mut version) = (None, arrow_ipc::MetadataVersion::V5);
    let (mut dictionaries, mut batches) = (Vec::new(), Vec::new());
    while pos + 4 <= data.len() {
        let word = |at: usize| i32::from_le_bytes(data[at..at + 4].try_into().expect("4 bytes"));
        let (prefix, len) = if data[pos..pos + 4] == CONTINUATION {
            if pos + 8 > data.len() {
                return Err("truncated message".into());
            }
            (8usize, word(pos + 4))
        } else {
            (4, word(pos)) // the format before 0.15: no continuation marker
        };
        if len == 0 {
            break; // end of stream
        }
        let len = usize::try_from(len).map_err(|_| "negative message length".to_string())?;
        let Some(fb) = data.get(pos + prefix..pos + prefix + len) else {
            return Err("truncated message".into());
        };
        let message = arrow_ipc::root_as_message(fb).map_err(|e| format!("bad message: {e}"))?;
        let block = Block::new(pos as i64, (prefix + len) as i32, message.bodyLength());
        check_block(data, &block)?;
        match message.header_type() {
            MessageHeader::Schema if schema.is_none() => {
                let fb = message.header_as_schema().ok_or("bad schema message")?;
                schema = Some(arrow_ipc::convert::try_fb_to_schema(fb).map_err(|e| e.to_string())?);
                version = message.version();
            }
            MessageHeader::DictionaryBatch if batches.is_empty() => dictionaries.push(block),
            MessageHeader::DictionaryBatch => {
                // Each batch would need the dictionary in force when it was written: not kept per batch.
                return Err("a dictionary replaced after the first batch is not supported".into());
            }
            MessageHeader::RecordBatch => batches.push(block),
            other => return Err(format!("unexpected message {other:?}")),
        }
        pos += prefix + len + message.bodyLength() as usize;
    }
    let schema = schema.ok_or("no schema message (not Arrow IPC?)")?;
    Ok(Layout {
        schema: Arc::new(schema),
        version,
        dictionaries,
        batches,
    })
}

/// A column holding a field: its position in the schema and its name.
#[derive(Clone, Debug, PartialEq)]
pub struct Col {
    pub index: usize,
    pub name: String,
}

/// Which columns hold a record's fields.
#[derive(Clone, Debug, PartialEq)]
pub enum TableColumns {
    Recipe {
        title: Col,
        ingredients: Col,
        directions: Col,
        ner: Option<Col>,
    },
    /// Pre-rendered `source`/`target`, used verbatim.
    Pair { source: Col, target: Col },
}

impl TableColumns {
    /// Finds the fields' columns in `schema` (see the module doc); Err names a missing column (with the ones the
    /// file has) or a column of a type that cannot hold text.
    pub fn resolve(schema: &Schema, names: &ColumnNames) -> std::result::Result<Self, String> {
        let has: Vec<String> = schema.fields().iter().map(|f| f.name().clone()).collect();
        let find = |field: &str, defaults: &[&str]| -> std::result::Result<Option<Col>, String> {
            let candidates = names.candidates(field, defaults);
            let Some((index, name)) = candidates
                .iter()
                .find_map(|c| has.iter().position(|h| h == c).map(|i| (i, c.to_string())))
            else {
                return Ok(None);
            };
            let dt = schema.field(index).data_type();
            if !holds_text(dt) {
                return Err(format!(
                    "{} is {dt}: a field needs strings or lists of strings",
                    names.describe(field, &name)
                ));
            }
            Ok(Some(Col { index, name }))
        };
        let need = |field: &str, defaults: &[&str]| -> std::result::Result<Col, String> {
            find(field, defaults)?.ok_or_else(|| {
                let name = names.mapped(field).unwrap_or(defaults[0]);
                formats::missing_column(names, field, name, &has)
            })
        };
        // Pairs when there is a target column: RecipeNLG's `source` column says where a recipe was gathered.
        if names.maps_pair() || find("target", formats::TARGET)?.is_some() {
            return Ok(TableColumns::Pair {
                source: need("source", formats::SOURCE)?,
                target: need("target", formats::TARGET)?,
            });
        }
        let ner = match names.mapped("ner") {
            Some(_) => Some(need("ner", formats::NER)?),
            None => find("ner", formats::NER)?,
        };
        Ok(TableColumns::Recipe {
            title: need("title", formats::TITLE)?,
            ingredients: need("ingredients", formats::INGREDIENTS)?,
            directions: need("directions", formats::DIRECTIONS)?,
            ner,
        })
    }

    /// The columns read, in schema order.
    pub fn columns(&self) -> Vec<&Col> {
        let mut cols = match self {
            TableColumns::Recipe {
                title,
                ingredients,
                directions,
                ner,
            } => {
                let mut v = vec![title, ingredients, directions];
                v.extend(ner);
                v
            }
            TableColumns::Pair { source, target } => vec![source, target],
        };
        cols.sort_by_key(|c| c.index);
        cols.dedup_by_key(|c| c.index);
        cols
    }

    /// The record in `row` of `batch`, or why it is skipped.
    pub fn parse(&self, batch: &RecordBatch, row: usize) -> std::result::Result<Parsed, Skip> {
        let mut bytes = 0usize;
        let mut get = |col: &Col, list: bool| -> std::result::Result<Option<Field>, Skip> {
            let f = value(batch.column(col.index).as_ref(), row, &col.name, list)?;
            bytes += match &f {
                Some(Field::Text(s)) => s.len(),
                Some(Field::List(v)) => v.iter().map(String::len).sum(),
                None => 0,
            };
            Ok(f)
        };
        let null = |col: &Col| Skip::new("missing_field", format!("`{}` is null", col.name));
        let text = |f: Field| match f {
            Field::Text(s) => s,
            Field::List(v) => v.join(" "),
        };
        let parsed = match self {
            TableColumns::Pair { source, target } => {
                let s = text(get(source, false)?.ok_or_else(|| null(source))?);
                let t = text(get(target, false)?.ok_or_else(|| null(target))?);
                if s.trim().is_empty() {
                    return Err(Skip::new("empty_source", "empty `source`"));
                }
                if t.trim().is_empty() {
                    return Err(Skip::new("empty_target", "empty `target`"));
                }
                Parsed::Pair {
                    source: s,
                    target: t,
                }
            }
            TableColumns::Recipe {
                title,
                ingredients,
                directions,
                ner,
            } => {
                let title_text = text(get(title, false)?.ok_or_else(|| null(title))?);
                let ingredients_field = get(ingredients, true)?.ok_or_else(|| null(ingredients))?;
                let directions_field = get(directions, true)?.ok_or_else(|| null(directions))?;
                let ner_field = match ner {
                    Some(c) => get(c, true)?,
                    None => None,
                };
                Parsed::Recipe(Recipe {
                    title: title_text,
                    ner: ner_field.unwrap_or_else(|| ingredients_field.clone()),
                    ingredients: ingredients_field,
                    directions: directions_field,
                })
            }
        };
        if bytes > MAX_RECORD_BYTES {
            return Err(Skip::new(
                "over_long",
                format!("record of {bytes} bytes (limit {MAX_RECORD_BYTES})"),
            ));
        }
        Ok(parsed)
    }
}

fn is_string(dt: &DataType) -> bool {
    matches!(
        dt,
        DataType::Utf8
            | DataType::LargeUtf8
            | DataType::Utf8View
            | DataType::Binary
            | DataType::LargeBinary
            | DataType::BinaryView
    )
}

fn holds_text(dt: &DataType) -> bool {
    match dt {
        DataType::List(f) | DataType::LargeList(f) => is_string(f.data_type()),
        dt => is_string(dt),
    }
}

/// A column of strings (or of bytes that should be UTF-8).
enum Strings<'a> {
    Utf8(&'a StringArray),
    LargeUtf8(&'a LargeStringArray),
    Utf8View(&'a StringViewArray),
    Binary(&'a BinaryArray),
    LargeBinary(&'a LargeBinaryArray),
    BinaryView(&'a BinaryViewArray),
}

impl<'a> Strings<'a> {
    fn of(a: &'a dyn Array) -> Option<Strings<'a>> {
        Some(match a.data_type() {
            DataType::Utf8 => Strings::Utf8(a.as_string::<i32>()),
            DataType::LargeUtf8 => Strings::LargeUtf8(a.as_string::<i64>()),
            DataType::Utf8View => Strings::Utf8View(a.as_string_view()),
            DataType::Binary => Strings::Binary(a.as_binary::<i32>()),
            DataType::LargeBinary => Strings::LargeBinary(a.as_binary::<i64>()),
            DataType::BinaryView => Strings::BinaryView(a.as_binary_view()),
            _ => return None,
        })
    }

    fn array(&self) -> &dyn Array {
        match self {
            Strings::Utf8(a) => *a,
            Strings::LargeUtf8(a) => *a,
            Strings::Utf8View(a) => *a,
            Strings::Binary(a) => *a,
            Strings::LargeBinary(a) => *a,
            Strings::BinaryView(a) => *a,
        }
    }

    /// Item `i`, None when null.
    fn get(&self, i: usize, column: &str) -> Option<std::result::Result<&'a str, Skip>> {
        if self.array().is_null(i) {
            return None;
        }
        let bytes: &'a [u8] = match self {
            Strings::Utf8(a) => return Some(Ok(a.value(i))),
            Strings::LargeUtf8(a) => return Some(Ok(a.value(i))),
            Strings::Utf8View(a) => return Some(Ok(a.value(i))),
            Strings::Binary(a) => a.value(i),
            Strings::LargeBinary(a) => a.value(i),
            Strings::BinaryView(a) => a.value(i),
        };
        Some(
            std::str::from_utf8(bytes).map_err(|e| {
                Skip::new("invalid_utf8", format!("invalid UTF-8 in `{column}`: {e}"))
            }),
        )
    }
}

/// The field in `row` of `array` (None when null). `list`: a string is read as a list where it spells one.
fn value(
    array: &dyn Array,
    row: usize,
    column: &str,
    list: bool,
) -> std::result::Result<Option<Field>, Skip> {
    fn items<O: arrow_array::OffsetSizeTrait>(
        l: &arrow_array::GenericListArray<O>,
        row: usize,
        column: &str,
    ) -> std::result::Result<Option<Field>, Skip> {
        if l.is_null(row) {
            return Ok(None);
        }
        let values =
            Strings::of(l.values().as_ref()).expect("checked when the columns were resolved");
        let offsets = l.value_offsets();
        let (a, b) = (offsets[row].as_usize(), offsets[row + 1].as_usize());
        let mut out = Vec::with_capacity(b - a);
        for i in a..b {
            match values.get(i, column) {
                Some(s) => out.push(s?.to_string()),
                None => {
                    return Err(Skip::new(
                        "malformed_row",
                        format!("`{column}` holds a null item"),
                    ))
                }
            }
        }
        Ok(Some(Field::List(out)))
    }
    match array.data_type() {
        DataType::List(_) => items(array.as_list::<i32>(), row, column),
        DataType::LargeList(_) => items(array.as_list::<i64>(), row, column),
        _ => {
            let strings = Strings::of(array).expect("checked when the columns were resolved");
            match strings.get(row, column) {
                None => Ok(None),
                Some(s) => {
                    let s = s?;
                    Ok(Some(if list {
                        formats::list_or_text(s)
                    } else {
                        Field::Text(s.to_string())
                    }))
                }
            }
        }
    }
}

/// A Parquet file's reader over the columns `names` needs, in batches of [`COPY_BATCH_ROWS`] rows, with those
/// columns as the batches hold them (their positions in the projected batches).
fn parquet_reader(
    path: &Path,
    names: &ColumnNames,
    shown: &str,
) -> Result<(ParquetRecordBatchReader, SchemaRef, TableColumns)> {
    let bad = |e: String| LoaderError::file(shown, e);
    let mut file = File::open(path).map_err(|e| LoaderError::io(shown, "", &e))?;
    crate::parquet_footer::check(&mut file)
        .map_err(|e| bad(format!("not a valid Parquet file: {e}")))?;
    let builder = ParquetRecordBatchReaderBuilder::try_new(file)
        .map_err(|e| bad(format!("not a valid Parquet file: {e}")))?;
    let cols = TableColumns::resolve(builder.schema(), names)
        .map_err(|e| LoaderError::data(shown, 0, e))?;
    let indices: Vec<usize> = cols.columns().iter().map(|c| c.index).collect();
    let schema = Arc::new(
        builder
            .schema()
            .project(&indices)
            .map_err(|e| bad(e.to_string()))?,
    );
    let projected =
        TableColumns::resolve(&schema, names).map_err(|e| LoaderError::data(shown, 0, e))?;
    let mask = ProjectionMask::roots(builder.parquet_schema(), indices);
    let reader = builder
        .with_projection(mask)
        .with_batch_size(COPY_BATCH_ROWS)
        .build()
        .map_err(|e| bad(format!("cannot read Parquet: {e}")))?;
    Ok((reader, schema, projected))
}

/// Decodes the columns `names` needs from the Parquet or (compressed) Arrow file `src` into the uncompressed
/// Arrow IPC file `dest` (written whole or not at all), in batches of at most [`COPY_BATCH_ROWS`] rows; `stop`
/// ends it between batches. `shown` names `src` in errors.
pub fn convert(
    src: &Path,
    format: Format,
    dest: &Path,
    names: &ColumnNames,
    shown: &str,
    stop: &AtomicBool,
) -> Result<()> {
    let bad = |e: String| LoaderError::file(shown, e);
    let read_err = |e: arrow_schema::ArrowError| bad(format!("cannot read: {e}"));
    let mut failed: Option<LoaderError> = None;
    let write = |out: &mut File| -> std::io::Result<()> {
        let res = (|| -> Result<()> {
            let out = std::io::BufWriter::with_capacity(1 << 20, out);
            let mut w = match format {
                Format::Parquet => {
                    let (reader, schema, _) = parquet_reader(src, names, shown)?;
                    let mut w =
                        FileWriter::try_new(out, &schema).map_err(|e| bad(e.to_string()))?;
                    for batch in reader {
                        cancel::check(stop)?;
                        w.write(&batch.map_err(read_err)?)
                            .map_err(|e| write_error(dest, e))?;
                    }
                    w
                }
                _ => {
                    let table = ArrowTable::open(src, shown)?;
                    let cols = TableColumns::resolve(table.schema(), names)
                        .map_err(|e| LoaderError::data(shown, 0, e))?;
                    let indices: Vec<usize> = cols.columns().iter().map(|c| c.index).collect();
                    let schema = table
                        .schema()
                        .project(&indices)
                        .map_err(|e| bad(e.to_string()))?;
                    let mut w =
                        FileWriter::try_new(out, &schema).map_err(|e| bad(e.to_string()))?;
                    for k in 0..table.num_batches() {
                        cancel::check(stop)?;
                        let batch = table.batch(k).map_err(|e| bad(format!("batch {k}: {e}")))?;
                        let batch = batch.project(&indices).map_err(read_err)?;
                        for start in (0..batch.num_rows()).step_by(COPY_BATCH_ROWS) {
                            let n = COPY_BATCH_ROWS.min(batch.num_rows() - start);
                            w.write(&batch.slice(start, n))
                                .map_err(|e| write_error(dest, e))?;
                        }
                    }
                    w
                }
            };
            w.finish().map_err(|e| write_error(dest, e))?;
            let mut out = w.into_inner().map_err(|e| write_error(dest, e))?;
            std::io::Write::flush(&mut out)
                .map_err(|e| LoaderError::io(dest.display(), "cannot write the decoded copy", &e))
        })();
        res.map_err(|e| {
            failed = Some(e);
            std::io::Error::other("conversion failed")
        })
    };
    let written = crate::paths::write_atomic(dest, write);
    match (written, failed) {
        (_, Some(e)) => Err(e),
        (Err(e), None) => Err(LoaderError::io(
            dest.display(),
            "cannot write the decoded copy",
            &e,
        )),
        (Ok(()), None) => Ok(()),
    }
}

fn write_error(dest: &Path, e: arrow_schema::ArrowError) -> LoaderError {
    match e {
        arrow_schema::ArrowError::IoError(_, err) => {
            LoaderError::io(dest.display(), "cannot write the decoded copy", &err)
        }
        e => LoaderError::file(
            dest.display(),
            format!("cannot write the decoded copy: {e}"),
        ),
    }
}

/// Reads every row of the Parquet or Arrow file at `path` in order, without a copy: `f(row, parsed)` for each
/// (the sequential reader of `trainer generate`/`evaluate`). `shown` names the file in errors.
pub fn for_each_row(
    path: &Path,
    format: Format,
    names: &ColumnNames,
    shown: &str,
    mut f: impl FnMut(u64, std::result::Result<Parsed, Skip>),
) -> Result<()> {
    let bad = |e: String| LoaderError::file(shown, e);
    let mut row = 0u64;
    let mut each = |cols: &TableColumns, batch: &RecordBatch| {
        for r in 0..batch.num_rows() {
            f(row, cols.parse(batch, r));
            row += 1;
        }
    };
    if format == Format::Parquet {
        let (reader, _, cols) = parquet_reader(path, names, shown)?;
        for batch in reader {
            let batch = batch.map_err(|e| bad(format!("cannot read Parquet: {e}")))?;
            each(&cols, &batch);
        }
    } else {
        let table = ArrowTable::open(path, shown)?;
        let cols = TableColumns::resolve(table.schema(), names)
            .map_err(|e| LoaderError::data(shown, 0, e))?;
        for k in 0..table.num_batches() {
            let batch = table.batch(k).map_err(|e| bad(format!("batch {k}: {e}")))?;
            each(&cols, batch);
        }
    }
    Ok(())
}
