package kvledger.examples.violations;

import java.io.IOException;
import java.net.URI;
import java.net.http.HttpClient;
import java.net.http.HttpRequest;
import java.net.http.HttpResponse;
import java.nio.ByteBuffer;
import java.time.Duration;
import java.util.HashMap;
import java.util.Map;
import org.apache.avro.Schema;
import org.apache.avro.SchemaParseException;
import org.apache.avro.generic.GenericDatumReader;
import org.apache.avro.generic.GenericRecord;
import org.apache.avro.io.DecoderFactory;

/**
 * The Confluent wire framing: {@code 00} + the 4-byte big-endian id a Schema Registry gave the
 * writer schema + the Avro body. Writer schemas are fetched once per id with
 * {@code GET {url}/schemas/ids/{id}} and kept.
 */
final class ConfluentRegistry {
    private static final Duration TIMEOUT = Duration.ofSeconds(10);

    private final URI url;
    private final Schema reader;
    private final HttpClient http = HttpClient.newBuilder().connectTimeout(TIMEOUT).build();
    private final Map<Integer, GenericDatumReader<GenericRecord>> readers = new HashMap<>();

    ConfluentRegistry(URI url, Schema reader) {
        this.url = url;
        this.reader = reader;
    }

    GenericRecord decode(byte[] value) throws UndecodableRecordException {
        if (value.length < 5) {
            throw new UndecodableRecordException("a Confluent-framed record shorter than its header");
        }
        int id = ByteBuffer.wrap(value, 1, 4).getInt();
        GenericDatumReader<GenericRecord> datumReader = readers.get(id);
        if (datumReader == null) {
            datumReader = new GenericDatumReader<>(fetch(id), reader);
            readers.put(id, datumReader);
        }
        try {
            return datumReader.read(null, DecoderFactory.get().binaryDecoder(value, 5, value.length - 5, null));
        } catch (IOException | RuntimeException e) {
            throw new UndecodableRecordException(
                    "undecodable Avro body (schema id " + id + "): " + FatalError.rootCause(e));
        }
    }

    private Schema fetch(int id) throws UndecodableRecordException {
        URI uri = URI.create(url + "/schemas/ids/" + id);
        HttpResponse<String> response;
        try {
            HttpRequest request = HttpRequest.newBuilder(uri).timeout(TIMEOUT).GET().build();
            response = http.send(request, HttpResponse.BodyHandlers.ofString());
        } catch (IOException e) {
            // The client's own exception says it (ConnectException, HttpTimeoutException); its cause says less.
            String why = e.getMessage() != null ? e.getMessage() : e.getClass().getSimpleName();
            throw new FatalError("no Schema Registry answers at " + url + " (" + why + ")");
        } catch (InterruptedException e) {
            Thread.currentThread().interrupt();
            throw new FatalError("interrupted while asking " + uri);
        }
        if (response.statusCode() == 404) {
            throw new UndecodableRecordException("schema id " + id + " is not in the registry at " + url);
        }
        if (response.statusCode() != 200) {
            throw new FatalError("GET " + uri + " answered HTTP " + response.statusCode());
        }
        String text = Json.readStringField(response.body(), "schema");
        if (text == null) {
            throw new FatalError("GET " + uri + " answered without a \"schema\" field");
        }
        try {
            return new Schema.Parser().parse(text);
        } catch (SchemaParseException e) {
            throw new UndecodableRecordException("schema id " + id + " is not an Avro schema: " + e.getMessage());
        }
    }
}
